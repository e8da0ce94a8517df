
import json
import os
import sys
import time

rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
time.sleep(0.8)  # start-up, silent
os.write(2, b"UserWarning: Failed to initialize NumPy\n")  # as torch's import may: not progress
time.sleep(0.4)
t = time.time()
os.write(1, f"step 0 rank {rank}\n".encode())  # matches --progress-pattern: progress
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"rank": rank, "attempt": attempt, "event": "line", "t": t}) + "\n")
if rank == 1 and attempt == 0:
    time.sleep(0.3)
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps({"rank": rank, "attempt": attempt, "event": "exit",
                            "t": time.time()}) + "\n")
    os._exit(3)
time.sleep(1.5)
