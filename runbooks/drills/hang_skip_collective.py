"""Drill: one rank skips a collective, the others wait in it until the timeout.

Symptom reproduced: the job "hangs" in an all_reduce. With the default timeout (30 min on
gloo, 10 min on NCCL) that is a 30-minute silence; with --timeout-s 3 it is a clear error in
seconds. Then three ways to learn *which* rank is missing:
  * TORCH_DISTRIBUTED_DEBUG=DETAIL: every collective is preceded by a monitored barrier, so the
    error itself names the missing rank ("Ranks 1 failed to pass monitoredBarrier in 3000 ms").
  * --detect monitored-barrier: an explicit dist.monitored_barrier(wait_all_ranks=True) before
    each all_reduce (what DETAIL does for you, at one place you choose) names every absent rank.
    --detect after-timeout shows why it must come *before*: once gloo has timed out, the pair
    is closed and the barrier only says "Application timeout caused pair closure".
  * --fr-dir DIR: every rank dumps its flight-recorder buffer (on the error, or on the SIGTERM
    torchrun sends to the survivors), ready for `torchfrtrace DIR/fixed -p rank_`.
--fixed applies the real fix: the skip decision is agreed by all ranks (one all_reduce of a flag),
so everybody skips together.

Run (CPU, gloo; the NCCL variant behaves the same but is GPU only and not executed in CI):
    torchrun --standalone --nproc-per-node 2 runbooks/drills/hang_skip_collective.py --timeout-s 3
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 \\
        runbooks/drills/hang_skip_collective.py --timeout-s 3
    torchrun --standalone --nproc-per-node 2 runbooks/drills/hang_skip_collective.py \\
        --timeout-s 3 --fr-dir /tmp/fr && torchfrtrace /tmp/fr/fixed -p rank_
Runbooks: runbooks/collective-timeout.md, runbooks/stuck-rank.md.
"""

import argparse
import datetime
import os
import pickle
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=3.0,
                        help="init_process_group timeout: how long a rank waits in a collective")
    parser.add_argument("--steps", type=int, default=4, help="training steps (one all_reduce each)")
    parser.add_argument("--skip-step", type=int, default=2, help="step at which a rank skips")
    parser.add_argument("--skip-rank", type=int, default=1, help="the rank that skips")
    parser.add_argument("--stall-s", type=float, default=20.0,
                        help="how long the skipping rank stays away (its own eval, I/O, ...)")
    parser.add_argument("--detect", choices=["none", "monitored-barrier", "after-timeout"],
                        default="none",
                        help="monitored-barrier: dist.monitored_barrier before each all_reduce; "
                             "after-timeout: call it only once the all_reduce has failed")
    parser.add_argument("--fr-dir", default="",
                        help="dump each rank's flight-recorder buffer here (raw/ and fixed/)")
    parser.add_argument("--fr-stacks", action="store_true",
                        help="include Python stacks in the dump (the first such dump in a "
                             "process takes seconds: one-time symbolizer set-up)")
    parser.add_argument("--fixed", action="store_true",
                        help="agree on the skip with an all_reduce, so all ranks skip together")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0 or args.stall_s < 0 or args.steps < 1:
        parser.exit(2, "hang_skip_collective.py: error: --timeout-s must be > 0, --stall-s >= 0, "
                       "--steps >= 1\n")
    return args


def dump_flight_recorder(directory, rank, world_size, with_stacks):
    """Write this rank's flight-recorder buffer twice: raw/rank_N exactly as torch returns it,
    and fixed/rank_N with the process-group table filled in.

    Why two: on torch 2.13 the gloo backend records every collective but leaves `pg_config`
    empty ({'': ...}); only NCCL fills it. torchfrtrace then fails with KeyError: ('0', 0).
    Filling pg_config from the entries (default group: every rank) is enough for the analyzer.
    `_dump_fr_trace` is the only in-process dump for gloo (no watchdog dumps it on timeout);
    it is private API, so it is looked up defensively. Stacks are off by default: the first
    dump with stacks in a process took 10-14 s here (symbolizer set-up), longer than is safe in
    a SIGTERM handler on a loaded machine (torchrun SIGKILLs 30 s after SIGTERM)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        # Present in 2.13; older wheels may only have _dump_nccl_trace (NCCL builds).
        print(f"rank {rank}: this torch has no _dump_fr_trace; cannot dump", flush=True)
        return
    trace = pickle.loads(dump(includeStackTraces=with_stacks))
    for sub, payload in (("raw", trace), ("fixed", with_pg_config(trace, world_size))):
        path = Path(directory) / sub / f"rank_{rank}"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(pickle.dumps(payload))
        os.replace(tmp, path)  # the analyzer never reads a half-written dump
    print(f"rank {rank}: flight recorder dumped {len(trace['entries'])} entries "
          f"to {directory}", flush=True)


def with_pg_config(trace, world_size):
    """The drill only uses the default group, whose members are all ranks."""
    groups = {entry["process_group"] for entry in trace["entries"]}
    config = {name: {"name": name, "desc": desc, "ranks": str(list(range(world_size)))}
              for name, desc in groups}
    return {**trace, "pg_config": config or trace["pg_config"]}


def stay_away(seconds):
    # Short sleeps, not one long one: a Python signal handler (the SIGTERM dump) only runs
    # when the main thread gets control back.
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


def train(args, rank, world_size):
    grad = torch.ones(1024)
    for step in range(1, args.steps + 1):
        wants_skip = rank == args.skip_rank and step == args.skip_step
        if args.fixed:
            # The fix: a skip is a collective decision. One tiny all_reduce (MAX) and every
            # rank skips the same step, so the collective sequence stays identical.
            flag = torch.tensor([float(wants_skip)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                if rank == 0:
                    print(f"step {step}: all ranks skip together", flush=True)
                continue
        elif wants_skip:
            print(f"rank {rank}: skipping the all_reduce of step {step} "
                  f"(away for {args.stall_s:.0f} s)", flush=True)
            stay_away(args.stall_s)
            continue
        if args.detect == "monitored-barrier":
            # Gloo only (in NCCL jobs use a gloo side group: dist.new_group(backend="gloo")).
            # Rank 0 waits for everybody and raises naming every rank that did not arrive.
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=args.timeout_s),
                                   wait_all_ranks=True)
        t0 = time.monotonic()
        try:
            dist.all_reduce(grad)
        except RuntimeError as exc:
            print(f"rank {rank}: all_reduce of step {step} failed after "
                  f"{time.monotonic() - t0:.1f} s: {exc}", flush=True)
            raise
        if rank == 0:
            print(f"step {step}: all_reduce ok", flush=True)


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.fr_dir:
        def on_sigterm(signum, frame):
            dump_flight_recorder(args.fr_dir, rank, world_size, args.fr_stacks)
            os._exit(143)  # 128 + SIGTERM, what a killed process would report
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        train(args, rank, world_size)
    except RuntimeError as exc:
        if args.detect == "monitored-barrier":
            print(f"rank {rank}: {exc}", flush=True)
        if args.detect == "after-timeout":
            try:
                # Too late: the timed-out gloo pair is already closed.
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=args.timeout_s),
                                       wait_all_ranks=True)
            except RuntimeError as exc:
                print(f"rank {rank}: monitored_barrier: {exc}", flush=True)
        if args.fr_dir:
            dump_flight_recorder(args.fr_dir, rank, world_size, args.fr_stacks)
        sys.exit(1)  # no destroy_process_group: the group is broken, just leave
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
