
import json
import os
import sys

secret = sys.argv[1]
with open(secret, "w") as f:
    json.dump({"message": {"message": "RuntimeError: planted-secret-text",
                           "extraInfo": {"py_callstack": "", "timestamp": "0"}}}, f)
path = os.environ["TORCHELASTIC_ERROR_FILE"]
if sys.argv[2] == "symlink":
    os.symlink(secret, path)
else:
    os.replace(secret, path)
sys.exit(3)
