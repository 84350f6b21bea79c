"""Communication benchmark: algorithm and bus bandwidth of the collectives training uses.

Definitions are those of nccl-tests (doc/PERFORMANCE.md), so numbers compare across tools:
    algbw = S / t        S = bytes of the full buffer, t = time of one collective
    busbw = algbw * factor, with factor (n = world size)
        all_reduce      2 (n - 1) / n
        all_gather      (n - 1) / n      S = the gathered (output) buffer
        reduce_scatter  (n - 1) / n      S = the input buffer, before scattering
        all_to_all      (n - 1) / n
        broadcast       1
busbw is the per-link traffic of an optimal (ring) algorithm, so it can be compared with the
hardware's link bandwidth whatever n is. t is the slowest rank's mean over --iters (a
collective finishes when its last rank does). As the local limit, rank 0 also measures a
single-process memory copy of the largest buffer (copy bandwidth = S / t, one read and one
write of each byte) on the same device.

Launch:
    torchrun --standalone --nproc-per-node 2 labs/comm_bench.py            # CPU + gloo
    torchrun --standalone --nproc-per-node 8 labs/comm_bench.py --max-bytes 1G   # 8 GPUs
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29400 --rdzv-id $JOB_ID labs/comm_bench.py
Minimum world size: 1 (n = 1 measures only the local overhead: busbw is 0). Expected last line
(numbers from a loaded 2-vCPU VM; yours will differ):
    comm_bench: gloo x2 | cpu x2 | peak busbw all_reduce 0.20 GB/s @ 16 MiB | memcpy 0.83 GB/s
Runbook: runbooks/distributed-env-reference.md (section "Measure the links").
"""

import argparse
import datetime
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]


def bus_factor(op, n):
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def parse_bytes(text):
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not match:
        raise ValueError(text)
    return int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2)]


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; a tool prints one line and exits 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail_config(flag, message):
    print(f"comm_bench.py: error: {flag}: {message}", file=sys.stderr)
    sys.exit(2)


def parse_config(argv=None):
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--min-bytes", default="4K", help="smallest buffer S (suffix K, M, G)")
    parser.add_argument("--max-bytes", default="16M", help="largest buffer S (suffix K, M, G)")
    parser.add_argument("--step-factor", type=int, default=4, help="S grows by this factor")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per size")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per size")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda + nccl when every local rank has a GPU, else cpu + gloo")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="seconds any collective may block before it becomes an error")
    parser.add_argument("--json-out", default="", help="write all rows as JSON here (rank 0)")
    cfg = parser.parse_args(argv)
    cfg.ops = [op for op in cfg.ops.split(",") if op]
    bad = [op for op in cfg.ops if op not in OPS]
    if bad or not cfg.ops:
        fail_config("--ops", f"unknown {bad}; allowed: {','.join(OPS)}")
    for flag in ("min_bytes", "max_bytes"):
        try:
            setattr(cfg, flag, parse_bytes(getattr(cfg, flag)))
        except ValueError:
            fail_config(f"--{flag.replace('_', '-')}", f"{getattr(cfg, flag)!r} is not a size "
                        "like 4096, 64K, 16M or 1G")
    if not 0 < cfg.min_bytes <= cfg.max_bytes:
        fail_config("--min-bytes", "must be > 0 and <= --max-bytes")
    for flag in ("step_factor", "iters"):
        if getattr(cfg, flag) < (2 if flag == "step_factor" else 1):
            fail_config(f"--{flag.replace('_', '-')}", f"too small: {getattr(cfg, flag)}")
    if cfg.warmup < 0 or cfg.timeout_s <= 0:
        fail_config("--warmup" if cfg.warmup < 0 else "--timeout-s", "must be positive")
    return cfg


def init_distributed(cfg):
    if "RANK" not in os.environ:  # plain `python`: a world of one
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if cfg.device == "cuda" and not enough_gpus:
        fail_config("--device", f"cuda needs one GPU per local rank ({local_world})")
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if cfg.device == "cuda" or (cfg.device == "auto" and enough_gpus):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


# all_gather_single / reduce_scatter_single replace the *_tensor names in torch 2.13 (the old
# names warn there); torch 2.6-2.12 only have the old names.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def make_op(op, size_bytes, n, device):
    """Buffers for one collective with a full buffer of size_bytes; returns a callable."""
    numel = max(n, size_bytes // 4 // n * n)  # fp32, divisible by n for the scatter ops
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full), numel * 4
    if op == "all_gather":
        return lambda: ALL_GATHER(full, part), numel * 4
    if op == "reduce_scatter":
        return lambda: REDUCE_SCATTER(part, full), numel * 4
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full), numel * 4
    return lambda: dist.broadcast(full, src=0), numel * 4


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn, cfg, device):
    for _ in range(cfg.warmup):
        fn()
    sync(device)
    dist.barrier()  # start together: otherwise t includes waiting for the last rank to arrive
    t0 = time.perf_counter()
    for _ in range(cfg.iters):
        fn()
    sync(device)
    seconds = torch.tensor([(time.perf_counter() - t0) / cfg.iters], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank finishes the collective
    return seconds.item()


def memcpy_bandwidth(size_bytes, device, iters):
    src = torch.ones(size_bytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return src.numel() * 4 / ((time.perf_counter() - t0) / iters)


def sizes(cfg):
    size = cfg.min_bytes
    while size <= cfg.max_bytes:
        yield size
        size *= cfg.step_factor


def main(argv=None):
    cfg = parse_config(argv)
    rank, n, device = init_distributed(cfg)
    try:
        rows = []
        for op in cfg.ops:
            for size in sizes(cfg):
                fn, actual_bytes = make_op(op, size, n, device)
                seconds = time_op(fn, cfg, device)
                algbw = actual_bytes / seconds
                rows.append({"op": op, "bytes": actual_bytes, "time_us": seconds * 1e6,
                             "algbw_gbps": algbw / 1e9,
                             "busbw_gbps": algbw * bus_factor(op, n) / 1e9})
        if rank == 0:
            memcpy = memcpy_bandwidth(cfg.max_bytes, device, cfg.iters)
            report(cfg, rows, memcpy, n, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def report(cfg, rows, memcpy, n, device):
    print(f"{'op':<15} {'bytes':>10} {'time_us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for row in rows:
        print(f"{row['op']:<15} {row['bytes']:>10} {row['time_us']:>10.1f} "
              f"{row['algbw_gbps']:>11.3f} {row['busbw_gbps']:>11.3f}")
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu x{os.cpu_count()}"
    if cfg.json_out:
        path = Path(cfg.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({
            "backend": dist.get_backend(), "world_size": n, "device": device.type,
            "hardware": hardware, "host": socket.gethostname(), "torch": torch.__version__,
            "iters": cfg.iters, "memcpy_gbps": memcpy / 1e9, "memcpy_bytes": cfg.max_bytes,
            "rows": rows}, indent=2))
        os.replace(tmp, path)
    best = max((r for r in rows if r["op"] == "all_reduce"), default=None,
               key=lambda r: r["busbw_gbps"])
    peak = (f"peak busbw all_reduce {best['busbw_gbps']:.2f} GB/s @ "
            f"{best['bytes'] / 2**20:g} MiB" if best else "no all_reduce rows")
    print(f"comm_bench: {dist.get_backend()} x{n} | {hardware} | {peak} | "
          f"memcpy {memcpy / 1e9:.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
