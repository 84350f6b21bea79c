"""Drill: one rank is stuck in its own compute or data loading; the others wait in a collective.

Symptom reproduced: a collective timeout on the *healthy* ranks (here rank 0), while the
culprit (rank 1) is busy elsewhere and says nothing. `py-spy dump` on every rank shows it:
the healthy ranks sit in `all_reduce`, the straggler in `slow_forward` (--where compute) or in
the dataset's `__getitem__` (--where data).

    torchrun --standalone --nproc-per-node 2 runbooks/drills/hang_straggler.py --where data &
    sleep 10   # let it get stuck
    pgrep -P "$(pgrep -f -o torch.distributed.run)" | xargs -I{} py-spy dump --pid {}

--loader-timeout-s S (data only) is the fix for silent data stalls: the DataLoader loads in a
worker process and raises "DataLoader timed out after S seconds" *on the rank that is stuck*,
before the collective timeout fires on the innocent ones.
Runbook: runbooks/stuck-rank.md.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--where", choices=["compute", "data"], default="compute",
                        help="where the slow rank is stuck")
    parser.add_argument("--slow-rank", type=int, default=1, help="the rank that is stuck")
    parser.add_argument("--slow-step", type=int, default=2, help="step at which it gets stuck")
    parser.add_argument("--stall-s", type=float, default=60.0, help="how long it stays stuck")
    parser.add_argument("--timeout-s", type=float, default=20.0,
                        help="init_process_group timeout: how long the healthy ranks wait")
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--loader-timeout-s", type=float, default=0.0,
                        help="data only: DataLoader(timeout=...) with one worker (0: no worker)")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0 or args.stall_s < 0 or args.loader_timeout_s < 0:
        parser.exit(2, "hang_straggler.py: error: --timeout-s must be > 0, "
                       "--stall-s and --loader-timeout-s >= 0\n")
    return args


class SlowOnOneRank(Dataset):
    """Sample `slow_index` takes stall_s to load: a network filesystem, a corrupt file being
    retried, a decoder stuck on one input."""

    def __init__(self, slow_index, stall_s):
        self.slow_index, self.stall_s = slow_index, stall_s

    def __len__(self):
        return 1000

    def __getitem__(self, index):
        if index == self.slow_index:
            deadline = time.monotonic() + self.stall_s
            while time.monotonic() < deadline:
                time.sleep(0.05)
        return torch.ones(64)


def slow_forward(x, seconds):
    """Compute that takes far longer on one rank (a shape-dependent path, a CPU fallback)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        x = torch.tanh(x @ x.T @ x) / 64
    return x


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    print(f"rank {rank}: pid {os.getpid()}", flush=True)
    slow_here = rank == args.slow_rank
    slow_index = args.slow_step - 1 if slow_here and args.where == "data" else -1
    workers = 1 if args.loader_timeout_s else 0
    loader = DataLoader(SlowOnOneRank(slow_index, args.stall_s), batch_size=1,
                        num_workers=workers, timeout=args.loader_timeout_s)
    batches = iter(loader)
    for step in range(1, args.steps + 1):
        t0 = time.monotonic()
        try:
            x = next(batches).reshape(8, 8)
            if slow_here and args.where == "compute" and step == args.slow_step:
                x = slow_forward(x, args.stall_s)
            dist.all_reduce(x)  # the gradient sync where the healthy ranks end up waiting
        except RuntimeError as exc:
            print(f"rank {rank}: step {step} failed after {time.monotonic() - t0:.1f} s: {exc}",
                  flush=True)
            sys.exit(1)
        if rank == 0:
            print(f"step {step}: ok", flush=True)
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
