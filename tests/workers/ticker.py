
import os
import time

os.write(1, b"ready\n")
i = 0
while True:
    os.write(1, f"tick {i}\n".encode() * 20)
    i += 1
    time.sleep(0.02)
