"""Drill: one rank fails and torchrun ends the job with ChildFailedError.

Every rank joins a gloo process group; then --fail-rank fails in the way --how says, while the
other ranks wait for it: in a barrier (--victims collective, what training does) or just
sleeping (--victims idle, so only the failing rank shows up in the summary). torchrun notices,
stops the survivors with SIGTERM and prints its failure summary ("Root Cause (first observed
failure)"). Without --record the summary says `error_file: <N/A>` and "To enable traceback see
...": the traceback is only in the rank's own stderr. With --record, main() is wrapped in
torch.distributed.elastic.multiprocessing.errors.record, which writes the exception to the
error file torchrun gave the rank, and the summary shows the file and the traceback.

    torchrun --standalone --nproc-per-node 2 runbooks/drills/torchrun_child_failed.py
    torchrun --standalone --nproc-per-node 2 runbooks/drills/torchrun_child_failed.py --record
    torchrun --standalone --nproc-per-node 2 runbooks/drills/torchrun_child_failed.py \\
        --how sigkill --victims idle
Exit codes in the summary: exception 1, sigkill -9 (what the kernel OOM killer does), abort -6
(what a C++ abort does, e.g. the NCCL watchdog), preempted 75 (the labs' PREEMPTED_EXIT_CODE),
none 0 (no failure: the job succeeds).
Runbook: runbooks/torchrun-child-failed.md.
"""

import argparse
import datetime
import os
import signal
import sys
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

PREEMPTED_EXIT_CODE = 75  # the same value as labs/lab01_ddp.py (EX_TEMPFAIL)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true",
                        help="wrap main() with @record, so torchrun's summary shows the traceback")
    parser.add_argument("--fail-rank", type=int, default=1, help="the global rank that fails")
    parser.add_argument("--how", choices=["exception", "sigkill", "abort", "preempted", "none"],
                        default="exception", help="how that rank fails (none: it does not)")
    parser.add_argument("--victims", choices=["collective", "idle"], default="collective",
                        help="what the other ranks do meanwhile: wait in a barrier, or sleep")
    parser.add_argument("--delay-s", type=float, default=1.0,
                        help="seconds after the process group is up before the rank fails")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="process group timeout")
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        parser.exit(2, "torchrun_child_failed.py: error: run it under torchrun (see --help)\n")
    if args.delay_s < 0 or args.timeout_s <= 0:
        parser.exit(2, "torchrun_child_failed.py: error: --delay-s >= 0 and --timeout-s > 0\n")
    return args


def load_batch(step):
    """Stands in for the line of training code that breaks."""
    raise RuntimeError(f"corrupt sample in shard 7 at step {step}")


def fail(how, rank):
    print(f"rank {rank}: failing now ({how})", file=sys.stderr, flush=True)
    if how == "exception":
        load_batch(step=3)
    elif how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel OOM killer does: no cleanup at all
    elif how == "abort":
        os.abort()  # SIGABRT, as a C++ std::terminate or the NCCL watchdog does
    elif how == "preempted":
        sys.exit(PREEMPTED_EXIT_CODE)


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not 0 <= args.fail_rank < world_size:
        raise ValueError(f"--fail-rank {args.fail_rank} is not a rank of a world of {world_size}")
    print(f"rank {rank}: up (pid {os.getpid()}, world {world_size})", flush=True)
    dist.barrier()
    if rank == args.fail_rank and args.how != "none":
        time.sleep(args.delay_s)
        fail(args.how, rank)
    if args.how != "none" and args.victims == "idle":
        time.sleep(args.timeout_s)  # torchrun's SIGTERM ends this sleep
    dist.barrier()  # the ranks that did not fail wait here for the one that did
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    # In your own script, write @record on the line above `def main():`. The drill decides at
    # run time, so that one file shows the summary both with and without it.
    (record(main) if "--record" in sys.argv[1:] else main)()
