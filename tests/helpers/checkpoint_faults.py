"""`python -m tests.helpers.checkpoint_faults <pretrain_gpt flags>`: pretrain_gpt whose torch_dist write of
iteration $FAULT_ITERATION meets the fault $FAULT names, as a slow or full disk would make it:

    slow   the write waits $FAULT_SECONDS before it starts (an --async-save is then still writing while training
           goes on, for a test to SIGKILL the run in the middle of it)
    full   the write runs under a 1 KiB file size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with EFBIG,
           as on a full disk)

Other iterations are written normally.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time

from megatron_train.checkpointing import dist_checkpoint
from megatron_train.pretrain_gpt import main

_write_shards = dist_checkpoint.write_shards


def faulty_write_shards(iteration_dir: str, plan: dist_checkpoint.SavePlan) -> dict:
    if not iteration_dir.endswith(f"iter_{int(os.environ['FAULT_ITERATION']):07d}"):
        return _write_shards(iteration_dir, plan)
    if os.environ["FAULT"] == "slow":
        print(f"slow write of {iteration_dir} started", flush=True)
        time.sleep(float(os.environ["FAULT_SECONDS"]))
        return _write_shards(iteration_dir, plan)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
    try:
        return _write_shards(iteration_dir, plan)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)


if __name__ == "__main__":
    dist_checkpoint.write_shards = faulty_write_shards
    main(sys.argv[1:])
