"""Drill: a rank stalls in a collective on a sub-group of a 2-D mesh, and --timeout-s does not
apply there.

Symptom reproduced: `init_process_group(timeout=3 s)` and yet a job stays silent far longer than
3 s. In torch 2.13 the sub-groups that `init_device_mesh` creates (every mesh axis smaller than
the world), like `new_group()`, `split_group()` and `monitored_barrier()`, do not inherit the
default group's timeout: they fall back to the backend default, 30 min on gloo and 10 min on
NCCL. A stall on the "tp" or "dp" axis then lasts that long.

Four ranks form a (dp, tp) = (2, 2) mesh. Every rank prints the timeout of each axis; then
--stall-rank sleeps --stall-s seconds while the others all_reduce over their "tp" group.
  --mesh init_device_mesh   the axes report 0:30:00; the all_reduce simply waits out the stall
                            (no error at all, however long it is below 30 min)
  --mesh with-timeout       the fix, the labs' init_mesh (labkit/runtime.py): each axis
                            built with new_subgroups_by_enumeration(timeout=...) and wrapped
                            in DeviceMesh.from_group; the waiting ranks fail after
                            --timeout-s with an error that names the axis it waited on

Run (CPU, gloo; the NCCL default would be 10 min, GPU only and not executed in CI):
    torchrun --standalone --nproc-per-node 4 runbooks/drills/hang_subgroup.py --mesh init_device_mesh
    torchrun --standalone --nproc-per-node 4 runbooks/drills/hang_subgroup.py --mesh with-timeout
Runbooks: runbooks/collective-timeout.md (cause D), runbooks/distributed-env-reference.md.
"""

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "labs"))
from labkit.runtime import init_mesh  # noqa: E402  (the fix, exactly as the labs run it)

MESH_SHAPE, MESH_DIM_NAMES = (2, 2), ("dp", "tp")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", choices=["init_device_mesh", "with-timeout"],
                        default="init_device_mesh", help="how the (dp, tp) mesh is built")
    parser.add_argument("--timeout-s", type=float, default=3.0,
                        help="init_process_group timeout (and, with-timeout, every axis's)")
    parser.add_argument("--stall-rank", type=int, default=1, help="the rank that stalls")
    parser.add_argument("--stall-s", type=float, default=10.0,
                        help="how long it stays away before joining the all_reduce")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0 or args.stall_s < 0 or not 0 <= args.stall_rank < 4:
        parser.exit(2, "hang_subgroup.py: error: need --timeout-s > 0, --stall-s >= 0, "
                       "0 <= --stall-rank < 4\n")
    return args


def say(line):
    """One write per line: four ranks share the pipe, and print() writes the newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def group_timeout(group):
    """The timeout a group's gloo backend really uses (there is no public getter)."""
    return group._get_backend(torch.device("cpu")).options._timeout


def main(argv=None):
    args = parse_args(argv)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    if dist.get_world_size() != math.prod(MESH_SHAPE):
        sys.exit(f"hang_subgroup.py: run with --nproc-per-node {math.prod(MESH_SHAPE)}")
    if args.mesh == "init_device_mesh":
        mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_DIM_NAMES)
    else:
        mesh = init_mesh("cpu", MESH_SHAPE, MESH_DIM_NAMES, timeout)
    timeouts = {name: str(group_timeout(mesh[name].get_group())) for name in MESH_DIM_NAMES}
    say(f"rank {rank}: default group {group_timeout(dist.group.WORLD)} | "
        + " | ".join(f"axis {n} {t}" for n, t in timeouts.items()))
    tp_group = mesh["tp"].get_group()
    tp_ranks = dist.get_process_group_ranks(tp_group)
    if rank == args.stall_rank:
        say(f"rank {rank}: stalling {args.stall_s:.0f} s")
        time.sleep(args.stall_s)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=tp_group)
    except RuntimeError as exc:
        # Name what was waited for: gloo's own message says only "recv" and the milliseconds.
        say(f"rank {rank}: all_reduce on mesh axis 'tp' (ranks {tp_ranks}) failed after "
            f"{time.monotonic() - start:.1f} s: {str(exc).splitlines()[0]}")
        sys.exit(1)
    say(f"rank {rank}: all_reduce on mesh axis 'tp' (ranks {tp_ranks}) returned after "
        f"{time.monotonic() - start:.1f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
