import json
import os
import sys
import time

start_modules = sorted(sys.modules)
# imported after the snapshot above: what the job imports is what --preload auto learns
import psutil  # noqa: E402, F401
import rankreader_local  # noqa: E402
import rankreader_pkg  # noqa: E402

restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = sys.argv[1]
with open(os.path.join(out, f"{restart}.json.tmp"), "w") as f:
    json.dump({"modules": start_modules, "pkg": rankreader_pkg.RANK_AT_IMPORT,
               "local": rankreader_local.RANK_AT_IMPORT, "rank": os.environ["RANK"]}, f)
os.replace(os.path.join(out, f"{restart}.json.tmp"), os.path.join(out, f"{restart}.json"))
print(f"recorded {restart}", flush=True)
gate = os.path.join(out, f"go{restart}")
deadline = time.monotonic() + 120
while not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(1 if restart < 2 else 0)
