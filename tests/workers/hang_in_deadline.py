
import os
import signal
import sys
import time

from supervisor.worker import expires, heartbeat

rank = int(os.environ["RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
mode = sys.argv[1]
signal.signal(signal.SIGUSR1, lambda *_: os._exit(5))
if mode == "silent":
    heartbeat()  # one sign of life, then nothing
fifo = os.environ["TORCHELASTIC_TIMER_FILE"]
os.write(1, f"ready {rank} {os.getpid()} {restart} {fifo}\n".encode())
if mode == "hang" and rank == 1 and restart == 0:
    with expires(after=0.3, scope="step"):
        time.sleep(3600)
if mode == "release":
    with expires(after=0.3, scope="quick"):
        pass
    os.write(1, b"released\n")
    time.sleep(0.6)  # outlive the released deadline: nothing may fire
    sys.exit(0)
while True:
    time.sleep(3600)
