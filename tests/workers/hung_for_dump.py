
import os
import time

from supervisor.worker import expires


def stuck_in_the_named_function():
    with expires(after=0.5, scope="step"):
        os.write(1, f"ready {os.getpid()}\n".encode())
        time.sleep(3600)

stuck_in_the_named_function()
