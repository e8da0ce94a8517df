
import os
import time

from supervisor.worker import expires

rank = int(os.environ["RANK"])
os.write(1, f"ready {rank} {os.getpid()} {os.environ['TORCHELASTIC_RESTART_COUNT']}\n".encode())
step = 0
while True:
    with expires(after=3.0, scope="step"):
        time.sleep(1.0)
    step += 1
    os.write(1, f"step {rank} {step} {time.time():.3f}\n".encode())
