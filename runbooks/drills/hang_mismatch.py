"""Drill: ranks disagree about a collective (different shape, or a different op).

Symptom reproduced, on gloo:
  * shape mismatch (--kind shape): gloo aborts the process with
    "Received data size doesn't match expected size. Is there a distributed collective mismatch
    in your code?" and the peer sees "Connection reset by peer"; on NCCL the same bug can instead
    hang or silently corrupt (GPU only, not executed in CI).
  * op mismatch (--kind op): rank 1 calls all_gather while rank 0 calls all_reduce; both wait
    until the timeout ("Timed out waiting 3000ms for recv operation to complete").
  * with TORCH_DISTRIBUTED_DEBUG=DETAIL both become an immediate, named error:
    "Detected mismatch between collectives on ranks. Rank 0 is running collective: ..."
--fixed gives every rank the same shape and op, and the run completes.

Run:
    torchrun --standalone --nproc-per-node 2 runbooks/drills/hang_mismatch.py --kind shape
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 \\
        runbooks/drills/hang_mismatch.py --kind op
Runbook: runbooks/collective-timeout.md.
"""

import argparse
import datetime
import sys
import time

import torch
import torch.distributed as dist


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["shape", "op"], default="shape",
                        help="shape: rank 1 reduces 5 elements, not 4; op: rank 1 calls all_gather")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="init_process_group timeout")
    parser.add_argument("--steps", type=int, default=3, help="steps; the last one mismatches")
    parser.add_argument("--fixed", action="store_true", help="same shape and op on every rank")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0 or args.steps < 1:
        parser.exit(2, "hang_mismatch.py: error: --timeout-s must be > 0 and --steps >= 1\n")
    return args


def collective(kind, rank, world_size, mismatch):
    """The bug: a shape or an op chosen from rank-local state (an uneven last batch, a
    rank-only code path). Every rank must issue the same sequence of collectives, with the
    same shapes: the backend matches calls by their order, not by name."""
    if kind == "shape":
        numel = 5 if mismatch and rank == 1 else 4
        dist.all_reduce(torch.ones(numel))
    elif mismatch and rank == 1:
        out = [torch.zeros(4) for _ in range(world_size)]
        dist.all_gather(out, torch.ones(4))
    else:
        dist.all_reduce(torch.ones(4))


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in range(1, args.steps + 1):
        mismatch = step == args.steps and not args.fixed
        t0 = time.monotonic()
        try:
            collective(args.kind, rank, world_size, mismatch)
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
