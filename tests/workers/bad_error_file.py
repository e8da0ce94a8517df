
import os
import sys

path = os.environ["TORCHELASTIC_ERROR_FILE"]
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if sys.argv[1] == "nested":
        with open(path, "w") as f:
            f.write("[" * 100000)
    else:
        os.mkfifo(path)
    sys.exit(3)
os.write(1, b"second attempt\n")
