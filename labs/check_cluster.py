"""Cluster check: can every rank talk to every other rank? Plus a version and device report.

Run it before a long job, on exactly the nodes and launcher you will train with. It runs, with
a short timeout, each collective a training job needs and checks the *values*, not just that
the call returned:
    all_reduce   sum of ranks                     (the DDP gradient sync path)
    all_gather   every rank's identity record     (who is out there: host, device, versions)
    all_to_all   one element for every rank pair  (every pair of ranks exchanged data)
    broadcast    rank 0's payload, byte-exact     (how checkpoints and seeds are shared)
    barrier      everyone reached the end
A failing check prints one line naming the check (and the ranks that disagree) and exits 1;
a hang becomes an error after --timeout-s.

Launch (CPU + gloo, or one GPU per rank + nccl):
    python labs/check_cluster.py                               # 1 process, no torchrun
    torchrun --standalone --nproc-per-node 4 labs/check_cluster.py
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29400 --rdzv-id $JOB_ID labs/check_cluster.py
Debug a failing start-up with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET (NCCL only).
Minimum world size: 1. Expected last line (timings vary):
    check_cluster: OK | gloo x4 | 1 host(s) | torch 2.13.0+cpu | all_gather 5.4 ms | ...
Runbooks: runbooks/startup-hang.md, runbooks/distributed-env-reference.md.
"""

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; a tool prints one line and exits 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_config(argv=None):
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda + nccl when every local rank has a GPU, else cpu + gloo")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="seconds any collective may block before it becomes an error")
    parser.add_argument("--size-mb", type=float, default=4.0,
                        help="all_reduce payload per rank, MiB (a bandwidth sanity check)")
    parser.add_argument("--inject-bad-rank", type=int, default=-1,
                        help="self-test: this rank sends wrong all_to_all data (-1: none)")
    parser.add_argument("--json-out", default="", help="write the report as JSON here (rank 0)")
    cfg = parser.parse_args(argv)
    for flag, value in (("--timeout-s", cfg.timeout_s), ("--size-mb", cfg.size_mb)):
        if value <= 0:
            print(f"check_cluster.py: error: {flag}: must be > 0, got {value}", file=sys.stderr)
            sys.exit(2)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cfg.device == "cuda" and torch.cuda.device_count() < local_world:
        print(f"check_cluster.py: error: --device: cuda needs one GPU per local rank: "
              f"{local_world} ranks, {torch.cuda.device_count()} GPUs visible; use --device cpu",
              file=sys.stderr)
        sys.exit(2)
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
    use_cuda = cfg.device == "cuda" or (
        cfg.device == "auto" and torch.cuda.is_available()
        and torch.cuda.device_count() >= local_world)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init: else every communicator lands on cuda:0
        # device_id makes NCCL build its communicator now, so init errors surface here.
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def identity(device):
    nccl = torch.cuda.nccl.version() if device.type == "cuda" else None
    return {
        "rank": dist.get_rank(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "host": socket.gethostname(), "pid": os.getpid(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": dist.get_backend(),
        "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
    }


def timed(fn, device):
    """Run one check; returns (error or None, seconds)."""
    t0 = time.perf_counter()
    error = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # collectives are async on the GPU stream
    return error, time.perf_counter() - t0


def run_checks(cfg, rank, world_size, device):
    """Each check returns an error string or None. Values are checked on every rank."""
    numel = max(1, int(cfg.size_mb * 2**20 / 4))

    def all_reduce():
        x = torch.full((numel,), float(rank), device=device)
        dist.all_reduce(x)
        want = world_size * (world_size - 1) / 2
        bad = (x != want).any().item()
        return f"sum of ranks: got {x[0].item()}, want {want}" if bad else None

    def all_to_all():
        # Rank r sends r * world_size + p to rank p: every ordered pair of ranks is exercised.
        send = torch.arange(world_size, device=device, dtype=torch.float32) + rank * world_size
        if rank == cfg.inject_bad_rank:
            send += 0.5
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        want = torch.arange(world_size, device=device, dtype=torch.float32) * world_size + rank
        bad = [p for p in range(world_size) if recv[p].item() != want[p].item()]
        return f"wrong data from ranks {bad}" if bad else None

    def broadcast():
        payload = torch.arange(1024, device=device, dtype=torch.float32) * 3 + 7
        x = payload.clone() if rank == 0 else torch.zeros_like(payload)
        dist.broadcast(x, src=0)
        return None if torch.equal(x, payload) else "payload differs from rank 0's"

    def barrier():
        dist.barrier()
        return None

    results = []
    for name, fn in (("all_reduce", all_reduce), ("all_to_all", all_to_all),
                     ("broadcast", broadcast), ("barrier", barrier)):
        error, seconds = timed(fn, device)
        results.append({"check": name, "seconds": seconds, "error": error})
    return results


def main(argv=None):
    cfg = parse_config(argv)
    rank, world_size, device = init_distributed(cfg)
    try:
        me = identity(device)
        records = [None] * world_size
        t0 = time.perf_counter()
        dist.all_gather_object(records, me)  # also the first proof that everyone is connected
        gather_s = time.perf_counter() - t0
        gather_error = None if [r["rank"] for r in records] == list(range(world_size)) else \
            "records out of order"
        results = [{"check": "all_gather", "seconds": gather_s, "error": gather_error}]
        results += run_checks(cfg, rank, world_size, device)
        # Every rank's verdict goes to rank 0, so it can name the ranks that failed.
        verdicts = [None] * world_size
        dist.all_gather_object(verdicts, results)
        if rank == 0:
            failed = report(cfg, records, verdicts, world_size)
            if failed:
                sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def report(cfg, records, verdicts, world_size):
    print(f"{'rank':>4} {'host':<20} {'local':>5} {'device':<24} {'torch':<14} cuda / nccl")
    for r in records:
        print(f"{r['rank']:>4} {r['host'][:20]:<20} {r['local_rank']:>5} {r['device'][:24]:<24} "
              f"{r['torch']:<14} {r['cuda']} / {r['nccl']}")
    failed = []
    timings = {}
    for rank, results in enumerate(verdicts):
        for res in results:
            timings[res["check"]] = max(timings.get(res["check"], 0.0), res["seconds"])
            if res["error"]:
                failed.append(f"{res['check']} on rank {rank}: {res['error']}")
    versions = {r["torch"] for r in records}
    if len(versions) > 1:
        failed.append(f"torch versions differ between ranks: {sorted(versions)}")
    hosts = sorted({r["host"] for r in records})
    for line in failed:
        print(f"FAILED {line}")
    if cfg.json_out:
        path = Path(cfg.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"ok": not failed, "world_size": world_size, "hosts": hosts,
                                   "ranks": records, "max_seconds": timings,
                                   "failures": failed}, indent=2))
        os.replace(tmp, path)
    times = " | ".join(f"{name} {sec * 1e3:.1f} ms" for name, sec in timings.items())
    print(f"check_cluster: {'FAILED' if failed else 'OK'} | {records[0]['backend']} "
          f"x{world_size} | {len(hosts)} host(s) | torch {records[0]['torch']} | {times}",
          flush=True)
    return failed


if __name__ == "__main__":
    main()
