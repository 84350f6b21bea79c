"""Drill: training is finished, but the job does not end (or ends with an error).

Three cases:
  * --case thread: a non-daemon helper thread (a metrics uploader, an async checkpoint writer)
    is still running when main() returns. Python waits for it before exiting, so the rank never
    exits and torchrun waits for it forever. `py-spy dump` shows the thread ("upload_metrics").
    --fixed signals the thread to stop and joins it with a timeout before returning.
  * --case uneven: rank 1 has one batch fewer than rank 0 (an uneven shard), finishes, tears
    down and exits; rank 0 is still in its last all_reduce and fails at once with "Connection
    closed by peer" or "Connection reset by peer". On NCCL (GPU only, not executed in CI) the
    same bug is a hang until the watchdog timeout. --fixed gives every rank the same number of
    steps (what DistributedSampler(drop_last=True) or torch.distributed.algorithms.Join do).

  * --case ddp-outlives-group: destroy_process_group() runs while a DDP model is still alive
    (a global, or kept by a reference cycle) and a collective's tensor is still held by gloo.
    The model's C++ Reducer owns the last reference to the gloo group, so the group is torn
    down later, while the GIL is held or the interpreter is shutting down: the rank aborts with
    "terminate called without an active exception" (exit -6), or hangs in
    ~ProcessGroupGloo -> std::thread::join. --fixed frees the model (del + gc.collect()) before
    destroy_process_group().

    torchrun --standalone --nproc-per-node 2 runbooks/drills/hang_exit.py --case thread
    torchrun --standalone --nproc-per-node 2 runbooks/drills/hang_exit.py --case uneven
    torchrun --standalone --nproc-per-node 2 runbooks/drills/hang_exit.py --case ddp-outlives-group
Runbook: runbooks/exit-hang.md.
"""

import argparse
import datetime
import faulthandler
import gc
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["thread", "uneven", "ddp-outlives-group"],
                        default="thread",
                        help="thread: a non-daemon thread outlives main; uneven: unequal steps; "
                             "ddp-outlives-group: a DDP model outlives destroy_process_group()")
    parser.add_argument("--steps", type=int, default=3, help="steps on rank 0")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="init_process_group timeout")
    parser.add_argument("--thread-s", type=float, default=60.0,
                        help="thread case: how long the helper thread keeps running")
    parser.add_argument("--fixed", action="store_true", help="apply the fix for the case")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0 or args.steps < 2 or args.thread_s < 0:
        parser.exit(2, "hang_exit.py: error: --timeout-s must be > 0, --steps >= 2, "
                       "--thread-s >= 0\n")
    return args


def upload_metrics(stop, seconds):
    """Stands in for any background loop that never checks whether training has ended."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop.is_set():
        time.sleep(0.05)


leftover_model = None  # the broken ddp-outlives-group case parks its model here, like a global


def ddp_outlives_group(rank, fixed, exit_deadline_s):
    """Tear down the way most scripts do: destroy the group, let the model die at exit."""
    model = DDP(torch.nn.Linear(64, 64))
    model(torch.randn(8, 64)).sum().backward()
    if rank == 1:
        time.sleep(1.0)  # a slower rank: rank 0's last collective is still in flight below
    # A last async collective whose tensor only gloo's worker thread still references.
    pending = dist.all_reduce(torch.ones(1 << 20), async_op=True)
    if fixed:
        # Nothing may be in flight when the group goes: a pending collective keeps the group
        # alive too, and its last reference then dies on gloo's own worker thread (without
        # this wait the fixed case still aborted in 1 of 12 runs).
        pending.wait()
        del model
        gc.collect()  # DDP sits in reference cycles: del alone does not free its Reducer
    del pending  # the broken case drops it at once, still in flight
    dist.destroy_process_group()
    print(f"rank {rank}: training done, process group destroyed, exiting", flush=True)
    # Turn a hang at exit into an error naming it (prints every thread's stack, exit 1).
    faulthandler.dump_traceback_later(exit_deadline_s, exit=True)
    return model if not fixed else None  # broken: the model lives on, as a global would


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    if args.case == "ddp-outlives-group":
        global leftover_model
        leftover_model = ddp_outlives_group(rank, args.fixed, args.timeout_s)
        return
    stop = threading.Event()
    helper = None
    if args.case == "thread":
        # daemon=False is the default for threading.Thread: the interpreter waits for it at exit.
        helper = threading.Thread(target=upload_metrics, args=(stop, args.thread_s),
                                  name="upload_metrics")
        helper.start()
    steps = args.steps - 1 if args.case == "uneven" and rank == 1 and not args.fixed else args.steps
    for step in range(1, steps + 1):
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
        except RuntimeError as exc:
            print(f"rank {rank}: step {step} failed after {time.monotonic() - t0:.1f} s: {exc}",
                  flush=True)
            sys.exit(1)
    dist.destroy_process_group()
    print(f"rank {rank}: training done after {steps} steps, returning from main", flush=True)
    if helper is not None and args.fixed:
        stop.set()
        helper.join(timeout=5)  # bounded: a stuck helper must not block the exit forever
        print(f"rank {rank}: helper thread stopped", flush=True)


if __name__ == "__main__":
    main()
