"""A gloo DDP job (examples/ddp_train.py) whose rank --fault-rank raises once, first attempt."""

import os
import sys
from pathlib import Path

# examples/ of this checkout (tests/workers/ -> the repository root)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import ddp_train


def inject_faults(args, step, rank):
    # an exception on one rank, on the first attempt only
    if (rank == args.fault_rank and step == args.raise_at
            and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
        raise RuntimeError(f"injected failure at step {step}")

ddp_train.inject_faults = inject_faults
ddp_train.main()
sys.stdout.flush()
os._exit(0)
