
import os
import sys
import time

from supervisor.workers.spawn import DeathSignal, WorkerSpec, spawn_worker

death = DeathSignal()
spec = WorkerSpec(0, 0, [sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ))
worker = spawn_worker(spec, death)
os.write(1, f"{death.kind} {worker.pid}\n".encode())
time.sleep(600)
