"""Drill: rank 0 works alone (evaluation, a checkpoint write, preprocessing, a download) and the
other ranks time out waiting for it.

Symptom reproduced (2 ranks, gloo, the defaults --timeout-s 3 --busy-s 10):
  --busy-at step   after step 1 rank 0 "evaluates" for --busy-s; rank 1 goes on to step 2 and
                   its all_reduce fails after --timeout-s with gloo's
                   "Timed out waiting 3000ms for recv operation to complete".
  --busy-at init   rank 0 "preprocesses" *before* init_process_group; rank 1 waits inside
                   init_process_group for rank 0's address in the store and fails with
                   "DistStoreError: wait timeout after 3000ms, keys: /default_pg/0//cpu//0/0"
                   (the gloo twin of NCCL's "retrieving ncclUniqueId from [0]" timeout).
Every wait is bounded by a timeout; when rank 1 fails, torchrun SIGTERMs rank 0 mid-work.

The fixes (each exits 0 with the same --timeout-s 3 --busy-s 10):
  --fix before-init        every rank prepares its own shard of the data before
                           init_process_group: nobody waits for anybody while the work runs
  --fix everyone           the evaluation is sharded: every rank evaluates 1/world_size of it,
                           then one all_reduce combines the results
  --fix side-group         rank 0 still works alone, but the others wait for it in a barrier on
                           a gloo side group created with new_group(timeout=--wait-s), so the
                           training group keeps its short timeout
  --fix monitored-barrier  the same wait as a monitored_barrier on that side group; with
                           --wait-s shorter than --busy-s it fails on the waiting rank with an
                           error that names rank 0 (a diagnostic, not a fix). Its own
                           timeout= (--barrier-timeout-s) bounds only rank 0's wait: the
                           others wait for the side group's --wait-s
Raising --timeout-s above --busy-s also passes: the blunt fix. --rank0-crashes is the
contrast: a dead rank 0 makes the others fail at once, not after the timeout.

    torchrun --standalone --nproc-per-node 2 runbooks/drills/rank0_busy.py
    torchrun --standalone --nproc-per-node 2 runbooks/drills/rank0_busy.py --busy-at init
    torchrun --standalone --nproc-per-node 2 runbooks/drills/rank0_busy.py --fix side-group

Runbook: runbooks/rank0-busy.md.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

FIXES = ["none", "before-init", "everyone", "side-group", "monitored-barrier"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-at", choices=["step", "init"], default="step",
                        help="where rank 0 works alone: after step 1 (evaluation, checkpoint) "
                             "or before init_process_group (preprocessing, download)")
    parser.add_argument("--busy-s", type=float, default=10.0,
                        help="how long rank 0's work takes (well above --timeout-s, so that "
                             "torchrun stops rank 0 while it is still working)")
    parser.add_argument("--timeout-s", type=float, default=3.0,
                        help="init_process_group timeout: how long the other ranks wait")
    parser.add_argument("--fix", choices=FIXES, default="none", help="the fix to apply")
    parser.add_argument("--wait-s", type=float, default=60.0,
                        help="side-group / monitored-barrier: timeout of the gloo side group")
    parser.add_argument("--barrier-timeout-s", type=float, default=None,
                        help="monitored-barrier: its timeout= argument (default: --wait-s)")
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--rank0-crashes", action="store_true",
                        help="the contrast: rank 0 dies where it would have worked, and the "
                             "others fail at once instead of after the timeout")
    args = parser.parse_args(argv)
    if args.barrier_timeout_s is None:
        args.barrier_timeout_s = args.wait_s
    if min(args.timeout_s, args.wait_s, args.barrier_timeout_s) <= 0 or args.busy_s < 0 \
            or args.steps < 2:
        parser.exit(2, "rank0_busy.py: error: need --timeout-s, --wait-s and "
                       "--barrier-timeout-s > 0, --busy-s >= 0, --steps >= 2\n")
    if args.busy_at == "init" and args.fix in ("everyone", "side-group", "monitored-barrier"):
        parser.exit(2, f"rank0_busy.py: error: --fix {args.fix} needs a process group, so it "
                       "only applies to --busy-at step\n")
    if args.rank0_crashes and (args.busy_at == "init" or args.fix in ("everyone", "before-init")):
        parser.exit(2, "rank0_busy.py: error: --rank0-crashes replaces rank 0's work alone "
                       "after step 1: use it with --busy-at step and without --fix "
                       "everyone/before-init\n")
    return args


def work(seconds, what, rank):
    """Rank-local work with no collective inside: an evaluation, a checkpoint write, a
    download. Sleeps in short slices, so torchrun's SIGTERM ends it at once."""
    print(f"rank {rank}: {what} for {seconds:.1f} s", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return torch.tensor([seconds])  # stands in for a metric, e.g. the eval loss sum


def group_timeout(group):
    """The timeout a group's gloo backend really uses (there is no public getter)."""
    return group._get_backend(torch.device("cpu")).options._timeout


def evaluate(args, rank, world_size, side_group):
    """The block between step 1 and step 2 where rank 0 used to work alone."""
    if args.fix == "everyone":
        # Sharded evaluation: each rank takes 1/world_size of the batches, then one all_reduce
        # sums the metric. Nobody idles, and the wait is only the skew between ranks.
        metric = work(args.busy_s / world_size, "evaluating its shard", rank)
        dist.all_reduce(metric)
        return
    if rank == 0 and args.rank0_crashes:
        # 1 s first, so the others are surely waiting in their all_reduce when it dies.
        work(1.0, "evaluating, then crashing,", 0)
        os._exit(1)  # no clean-up, as in a segfault or an OOM kill
    if rank == 0:
        work(args.busy_s, "evaluating alone", 0)
    if args.fix == "side-group":
        # Everyone waits here, on gloo, for up to --wait-s; the default group's short timeout
        # still guards every training collective.
        dist.barrier(group=side_group)
    elif args.fix == "monitored-barrier":
        # timeout= bounds only rank 0's wait for the others. The others wait for rank 0 for
        # the side group's timeout (measured on torch 2.13): set both.
        dist.monitored_barrier(group=side_group,
                               timeout=datetime.timedelta(seconds=args.barrier_timeout_s))
    # --fix none: rank 1 goes straight on to step 2 and waits in its all_reduce.


def train(args, rank, world_size, side_group):
    for step in range(1, args.steps + 1):
        t0 = time.monotonic()
        where = f"all_reduce of step {step}"
        try:
            if step == 2 and args.busy_at == "step" and args.fix != "before-init":
                where = "evaluation before step 2"
                evaluate(args, rank, world_size, side_group)
                t0, where = time.monotonic(), f"all_reduce of step {step}"
            grad = torch.ones(1024)
            dist.all_reduce(grad)  # the gradient sync where the other ranks end up waiting
        except RuntimeError as exc:
            print(f"rank {rank}: {where} failed after {time.monotonic() - t0:.1f} s: {exc}",
                  flush=True)
            dist.destroy_process_group()  # else gloo's threads may abort the exit (SIGABRT)
            sys.exit(1)
        if rank == 0:
            print(f"step {step}: ok", flush=True)


def main(argv=None):
    args = parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    print(f"rank {rank}: pid {os.getpid()}", flush=True)
    if args.fix == "before-init":
        # Every rank prepares its own shard before any process group exists: no timeout runs
        # while they work, and they meet in init_process_group when all are done.
        work(args.busy_s / world_size, "preparing its shard before init_process_group", rank)
    elif args.busy_at == "init" and rank == 0:
        work(args.busy_s, "preparing the data alone before init_process_group", 0)
    t0 = time.monotonic()
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    except dist.DistError as exc:
        print(f"rank {rank}: init_process_group failed after {time.monotonic() - t0:.1f} s: "
              f"{type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
    side_group = None
    if args.fix in ("side-group", "monitored-barrier"):
        # new_group() does NOT inherit init_process_group's timeout (torch 2.13): pass it.
        side_group = dist.new_group(backend="gloo",
                                    timeout=datetime.timedelta(seconds=args.wait_s))
        unset = dist.new_group(backend="gloo")  # only to print what you get without timeout=
        if rank == 0:
            print(f"default group {group_timeout(dist.group.WORLD)} | side group "
                  f"{group_timeout(side_group)} | new_group() without timeout= "
                  f"{group_timeout(unset)}", flush=True)
    train(args, rank, world_size, side_group)
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
