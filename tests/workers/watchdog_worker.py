
import os
import signal
import subprocess
import sys
import time


def say(text):
    os.write(1, (text + "\n").encode())

def client():
    from supervisor.worker import TimerClient
    return TimerClient(os.environ["TORCHELASTIC_TIMER_FILE"])

mode, args = sys.argv[1], sys.argv[2:]
sys.stdin.readline()  # "go": the test has registered us
# set up, say ready, then post: a deadline that kills us at once cannot race "ready"
if "ignore-term" in (mode, *args):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "usr1":
    signal.signal(signal.SIGUSR1, lambda *_: say("usr1"))
if mode == "grandchild":  # the rest of argv is the grandchild's mode and args
    gc = subprocess.Popen([sys.executable, "-c", os.environ["WORKER"], *args],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    gc.stdin.write(b"go\n")
    gc.stdin.flush()
    assert gc.stdout.readline() == b"ready\n"
    say(f"grandchild {gc.pid}")
if mode.startswith("torch"):
    import torch.distributed.elastic.timer as timer
say("ready")
if mode == "deadline":  # AFTER SIGNUM [ignore-term]
    client().acquire("step", time.time() + float(args[0]), int(args[1]))
elif mode == "release":  # AFTER
    with client().expires(float(args[0]), "step"):
        pass
elif mode == "heartbeat":
    client().heartbeat()
elif mode == "torch-deadline":  # AFTER
    timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"], signal=signal.SIGKILL).acquire(
        "torch-step", time.time() + float(args[0]))
elif mode == "torch-release":
    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    with timer.expires(after=60, scope="torch-step"):
        pass
while True:
    time.sleep(3600)
