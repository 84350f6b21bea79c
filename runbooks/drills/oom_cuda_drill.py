"""Drill (GPU only): a real CUDA OOM, per-rank memory snapshots, and allocator settings.

Runbooks: runbooks/oom-reading-the-error.md, oom-memory-snapshots.md, oom-fragmentation.md,
oom-distributed-causes.md. Without CUDA it prints why and exits 2 (never a silent pass).

    python runbooks/drills/oom_cuda_drill.py oom            # a real OOM under a memory budget
    torchrun --nproc-per-node 2 runbooks/drills/oom_cuda_drill.py snapshot --out-dir /tmp/snaps
    PYTORCH_ALLOC_CONF=expandable_segments:True python runbooks/drills/oom_cuda_drill.py allocator
    torchrun --nproc-per-node 2 runbooks/drills/oom_cuda_drill.py set-device   # needs 2 GPUs
    python runbooks/drills/oom_cuda_drill.py load                # torch.load and map_location
    torchrun --nproc-per-node 2 runbooks/drills/oom_cuda_drill.py groups   # NCCL group memory
Each subcommand prints `key value` lines (greppable) and exits 0 when what it shows happened.
"""

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import oom_memory_drill as drill  # noqa: E402  (the model, the ledger, the predictions)

MiB = 2**20


def model_cfg(**overrides):
    cfg = {**dict(batch_size=16, seq_len=32, dim=64, num_layers=2, num_heads=4, vocab_size=64,
                  seed=0, lr=3e-3, rope_theta=1e4), **overrides}
    # lab01's debug model: no grouped-query attention, SwiGLU width 4 x dim (the ledger's count)
    cfg.setdefault("num_kv_heads", cfg["num_heads"])
    cfg.setdefault("ffn_dim", 4 * cfg["dim"])
    return argparse.Namespace(**cfg)


def train_steps(cfg, device, batch, seq_len, steps):
    model = drill.build(cfg, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    step_cfg = argparse.Namespace(**{**vars(cfg), "seq_len": seq_len})
    for step in range(steps):
        drill.accumulate_step(model, optimizer, step_cfg, device, batch, 1, offset=step * batch)


def cmd_oom(args):
    """Cap this process at a budget the prediction says is too small, then train: the
    allocator raises torch.OutOfMemoryError with the message the runbook dissects."""
    device = torch.device("cuda", 0)
    cfg = model_cfg(dim=512, num_layers=4, num_heads=8, vocab_size=4096)
    batch, seq_len = 16, 512
    predicted = drill.predict_step_peak(cfg, batch, seq_len)
    total = torch.cuda.get_device_properties(device).total_memory
    budget = predicted // 2
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
    print(f"predicted_peak_mib {predicted / MiB:.1f}")
    print(f"budget_mib {budget / MiB:.1f}")
    print(f"predicted_verdict {drill.verdict(predicted, budget, 0.10)}")
    try:
        train_steps(cfg, device, batch, seq_len, steps=2)
    except torch.OutOfMemoryError as exc:
        stats = torch.cuda.memory_stats(device)
        print(f"measured_verdict OOM\nnum_ooms {stats['num_ooms']}\n"
              f"num_alloc_retries {stats['num_alloc_retries']}")
        print(f"torch.OutOfMemoryError: {exc}")
        return 0
    print("measured_verdict fits (the prediction was wrong)")
    return 1


def cmd_snapshot(args):
    """Record allocator history for a few steps and dump ONE FILE PER RANK: ranks writing
    the same path overwrite each other."""
    rank, device = init_nccl()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    train_steps(model_cfg(), device, 16, 64, steps=3)  # the first step is an outlier
    path = out_dir / f"snapshot_rank{rank}.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)  # stop: it costs time per alloc
    print(f"snapshot {path} {path.stat().st_size} bytes")
    dist.destroy_process_group()
    return 0


def fragment(device):
    """Interleave short- and long-lived blocks of varying size, free the short ones, then
    ask for one big block: without expandable segments the holes cannot be reused for it."""
    keep, drop = [], []
    for i in range(64):
        (keep if i % 2 else drop).append(torch.empty((3 + i % 5) * MiB, dtype=torch.uint8,
                                                     device=device))
    del drop
    big = torch.empty(96 * MiB, dtype=torch.uint8, device=device)
    return keep, big


def cmd_allocator(args):
    device = torch.device("cuda", 0)
    settings = torch.cuda.memory._snapshot().get("allocator_settings", {})
    print(f"env PYTORCH_ALLOC_CONF={os.environ.get('PYTORCH_ALLOC_CONF', '')!r} "
          f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    print(f"allocator_settings_string {torch._C._accelerator_getAllocatorSettings()!r}")
    print(f"snapshot_expandable_segments {settings.get('expandable_segments')}")
    keep, big = fragment(device)
    stats = torch.cuda.memory_stats(device)
    print(f"reserved_mib {torch.cuda.memory_reserved(device) / MiB:.1f}")
    print(f"allocated_mib {torch.cuda.memory_allocated(device) / MiB:.1f}")
    print(f"inactive_split_mib {stats['inactive_split_bytes.all.current'] / MiB:.1f}")
    print(f"segments {stats['segment.all.current']}")
    print(f"num_alloc_retries {stats['num_alloc_retries']}")
    return 0


def cmd_set_device(args):
    """Without set_device every rank's tensors and NCCL communicator land on cuda:0."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    forgot = torch.empty(MiB, device="cuda").device  # "cuda" means the CURRENT device
    torch.cuda.set_device(local_rank)
    fixed = torch.empty(MiB, device="cuda").device
    print(f"rank {rank} without_set_device {forgot} with_set_device {fixed}")
    return 0 if forgot.index == 0 and fixed.index == local_rank else 1


def cmd_load(args):
    """torch.load puts tensors back on the device they were saved from, unless told."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt.pt"
        torch.save({"w": torch.ones(4, device="cuda:0")}, path)
        plain = torch.load(path, weights_only=True)["w"].device
        mapped = torch.load(path, map_location="cpu", weights_only=True)["w"].device
    print(f"load_without_map_location {plain}\nload_with_map_location {mapped}")
    return 0 if plain.type == "cuda" and mapped.type == "cpu" else 1


def cmd_groups(args):
    """Device memory that PyTorch's allocator does not see: each NCCL group's buffers."""
    rank, device = init_nccl()
    tensor = torch.ones(1024, device=device)
    dist.all_reduce(tensor)
    before = torch.cuda.device_memory_used(device)
    groups = [dist.new_group() for _ in range(args.num_groups)]
    for group in groups:
        dist.all_reduce(tensor, group=group)  # NCCL communicators are created lazily
    torch.cuda.synchronize(device)
    grown = torch.cuda.device_memory_used(device) - before
    print(f"rank {rank} groups {args.num_groups} device_memory_growth_mib {grown / MiB:.1f} "
          f"allocator_growth_mib {torch.cuda.memory_allocated(device) / MiB:.1f}")
    dist.destroy_process_group()
    return 0


def init_nccl():
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="29531")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=device)
    return dist.get_rank(), device


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("oom", help="a real CUDA OOM under a predicted-too-small budget")
    snap = sub.add_parser("snapshot", help="record and dump one snapshot file per rank")
    snap.add_argument("--out-dir", required=True, help="folder for snapshot_rank<N>.pickle")
    sub.add_parser("allocator", help="show the allocator settings in effect and its stats")
    sub.add_parser("set-device", help="where 'cuda' tensors land with and without set_device")
    sub.add_parser("load", help="torch.load with and without map_location")
    groups = sub.add_parser("groups", help="device memory taken by new NCCL groups")
    groups.add_argument("--num-groups", type=int, default=4, help="groups to create")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("oom_cuda_drill.py: error: needs a CUDA GPU; the CPU measurements are in "
              "oom_memory_drill.py", file=sys.stderr)
        return 2
    handlers = {"oom": cmd_oom, "snapshot": cmd_snapshot, "allocator": cmd_allocator,
                "set-device": cmd_set_device, "load": cmd_load, "groups": cmd_groups}
    return handlers[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
