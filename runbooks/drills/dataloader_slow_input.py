"""Drill: an input-bound job, and the DataLoader knobs that fix it (runbook dataloader-slow-input).

Each sample costs --io-ms of latency (time.sleep stands in for a read from network storage or a
remote bucket; it uses no CPU, like real I/O waits), and every worker process pays --open-ms
once when it first touches the data (opening shard files or a connection). Each step's compute
lasts at least --compute-ms (40 ms: a sleep tops up the tiny model's real step), so how much
loading the workers can hide does not depend on how fast this CPU is. The model trains
with DDP. For each DataLoader configuration the drill measures, on every rank, the share of
the step spent waiting for data, with the same definition as the labs' log line "data N%":

    data share = time blocked in next(loader) (plus the host-to-device copy)
                 / wall time of the whole step (that wait + forward + backward + all-reduce)

Run (CPU + gloo, or GPUs + nccl; a world of one without torchrun):
    torchrun --nproc-per-node 2 runbooks/drills/dataloader_slow_input.py
    python runbooks/drills/dataloader_slow_input.py --configs 0 2:2
Each --configs entry is WORKERS[:PREFETCH[:persistent]], e.g. 0, 4:2, 2:1, 4:2:persistent.
Output: one line per configuration and rank, e.g. (2-core CPU machine, gloo):
    workers 0 | prefetch - | persistent no  | rank 0 | step 106.8 ms | data 62% | epoch start 66 ms
    workers 4 | prefetch 2 | persistent no  | rank 0 | step 40.8 ms | data 2% | epoch start 570 ms
"""

import argparse
import datetime
import faulthandler
import gc
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad input: one line on stderr naming the flag, exit status 2 (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SlowDataset(Dataset):
    """Random features; every sample costs io_ms, every new process open_ms once."""

    def __init__(self, num_samples, dim, io_ms, open_ms):
        self.num_samples, self.dim, self.io_ms, self.open_ms = num_samples, dim, io_ms, open_ms
        self.opened_in_pid = None
        self.features = torch.randn(num_samples, dim, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        if self.opened_in_pid != os.getpid():  # a fresh worker: open files/connections again
            time.sleep(self.open_ms / 1e3)
            self.opened_in_pid = os.getpid()
        time.sleep(self.io_ms / 1e3)
        x = self.features[index]  # in memory: the only slow part is the simulated I/O
        return x, x.sum().sign()


def parse_loader_config(text):
    parts = text.split(":")
    try:
        workers = int(parts[0])
        prefetch = int(parts[1]) if len(parts) > 1 else (2 if workers else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want WORKERS[:PREFETCH[:persistent]]")
    persistent = len(parts) > 2 and parts[2] == "persistent"
    if workers < 0 or (prefetch is not None and prefetch < 1) or len(parts) > 3 or (
            len(parts) > 2 and not persistent) or (workers == 0 and (len(parts) > 1)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: WORKERS >= 0, PREFETCH >= 1 (only with WORKERS > 0), "
            f"third field only 'persistent'")
    return {"num_workers": workers, "prefetch_factor": prefetch, "persistent_workers": persistent}


def parse_args(argv=None):
    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", type=parse_loader_config,
                   default=[parse_loader_config(c) for c in
                            ["0", "1:2", "2:2", "4:2", "4:1", "4:8", "4:2:persistent"]],
                   help="DataLoader configurations to measure: WORKERS[:PREFETCH[:persistent]]")
    p.add_argument("--io-ms", type=float, default=4.0, help="latency of one sample, in ms")
    p.add_argument("--open-ms", type=float, default=500.0,
                   help="one-off cost for each process that opens the data, in ms")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--dim", type=int, default=256, help="model width")
    p.add_argument("--compute-ms", type=float, default=40.0,
                   help="each step's compute lasts at least this long (the rest is a sleep): "
                        "the GPU's share of a real step, so the drill means the same on a fast "
                        "or a slow CPU")
    p.add_argument("--epochs", type=int, default=2, help="epochs per configuration (>= 2)")
    p.add_argument("--steps-per-epoch", type=int, default=8, help="steps in one epoch")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="init_process_group and DataLoader timeout, in seconds")
    p.add_argument("--json-out", default="", help="write every rank's measurements here (rank 0)")
    args = p.parse_args(argv)
    for name in ["io_ms", "open_ms", "compute_ms"]:
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.steps_per_epoch < 2:
        p.error("--steps-per-epoch must be >= 2 (each epoch's first step is reported apart)")
    for name in ["batch_size", "dim", "timeout_s"]:
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.epochs < 2:
        p.error("--epochs must be >= 2 (epoch start is measured from the second epoch)")
    return args


def init_distributed(timeout_s):
    if "RANK" not in os.environ:  # plain python: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def measure(loader_kwargs, args, model, optimizer, rank, world_size, device):
    """Train --epochs epochs with one DataLoader; return this rank's timings."""
    dataset = SlowDataset(args.batch_size * world_size * args.steps_per_epoch, args.dim,
                          args.io_ms, args.open_ms)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        pin_memory=device.type == "cuda",
                        timeout=args.timeout_s if loader_kwargs["num_workers"] else 0,
                        **loader_kwargs)
    data_s = step_s = 0.0
    epoch_start_s = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (t_data, (x, y)) in enumerate(timed_batches(loader, device)):
            t0 = time.perf_counter()
            loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
            loss.backward()  # DDP all-reduces gradient buckets during backward
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()  # only so the wall clock sees the kernels finish
            # The model is tiny, so pad its compute to --compute-ms: without a floor the step's
            # length, and with it how much loading the workers can hide, is the CPU's speed.
            time.sleep(max(0.0, args.compute_ms / 1e3 - (time.perf_counter() - t0)))
            t_compute = time.perf_counter() - t0
            if i == 0:
                # The first batch of an epoch waits for (re)started workers: report it apart.
                if epoch > 0:
                    epoch_start_s.append(t_data)
                continue
            data_s += t_data
            step_s += t_data + t_compute
    return {"data_share": data_s / step_s, "step_ms": 1e3 * step_s / (args.epochs * (
        args.steps_per_epoch - 1)), "epoch_start_ms": 1e3 * sum(epoch_start_s) / len(epoch_start_s)}


def timed_batches(loader, device):
    """Yield (seconds spent getting the batch, batch): the 'data' part of every step."""
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            return
        batch = (x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        yield time.perf_counter() - t0, batch


def describe(cfg):
    prefetch = "-" if cfg["prefetch_factor"] is None else cfg["prefetch_factor"]
    return (f"workers {cfg['num_workers']} | prefetch {prefetch} | "
            f"persistent {'yes' if cfg['persistent_workers'] else 'no ':3s}")


def run(args, rank, world_size, device):
    """Every --configs entry on one DDP model; the model is freed when this returns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(),
                          nn.Linear(4 * args.dim, args.dim), nn.GELU(),
                          nn.Linear(args.dim, 1)).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=1e-3)
    results = []
    for cfg in args.configs:
        mine = measure(cfg, args, ddp_model, optimizer, rank, world_size, device)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, mine)
        results.append({"config": cfg, "per_rank": per_rank})
        if rank == 0:
            for r, m in enumerate(per_rank):
                print(f"{describe(cfg)} | rank {r} | step {m['step_ms']:.1f} ms | "
                      f"data {m['data_share']:.0%} | epoch start {m['epoch_start_ms']:.0f} ms",
                      flush=True)
    return results


def main(argv=None):
    args = parse_args(argv)
    # A rank that aborts (SIGABRT, e.g. "terminate called without an active exception" at exit)
    # prints every thread's Python stack first, so a rare abort says where it happened.
    faulthandler.enable(all_threads=True)
    rank, world_size, device = init_distributed(args.timeout_s)
    try:
        results = run(args, rank, world_size, device)
        if rank == 0 and args.json_out:
            payload = {"world_size": world_size, "args": {k: v for k, v in vars(args).items()
                                                          if k != "configs"}, "results": results}
            with open(args.json_out + ".tmp", "w") as f:
                json.dump(payload, f, indent=2)
            os.replace(args.json_out + ".tmp", args.json_out)
    finally:
        # The DDP model lived only inside run(); collect its cycles before the group goes, or
        # its Reducer can abort the exit (runbooks/exit-hang.md, cause D).
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
