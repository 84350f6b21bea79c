"""Drill: one rank's input pipeline is slow and every rank pays for it (runbook
dataloader-straggler-rank).

Only --slow-rank reads slow data (--io-ms per sample). Each step ends in an all-reduce of the
gradients, so the fast ranks wait there for the straggler: every rank logs the same step time,
and only the per-rank split shows who is late. Each rank prints its own line:

    rank 0 | workers 0 | step 143.9 ms | data 31% | comm 63%   <- a victim: waiting in all_reduce
    rank 1 | workers 0 | step 144.5 ms | data 70% | comm 21%   <- the straggler: waiting on data

data = time blocked in next(loader) / step wall time (the labs' "data N%" definition);
comm = time inside the gradient all_reduce / step wall time. The gradients are all-reduced
by hand, after backward, so the wait is visible on its own; with DDP it overlaps backward and
shows up as a slower backward on the fast ranks instead.

Run (a world of >= 2; CPU + gloo or GPUs + nccl):
    torchrun --nproc-per-node 2 runbooks/drills/dataloader_straggler.py --num-workers 0 4
    # a stall longer than the collective timeout: the fast ranks fail inside all_reduce
    torchrun --nproc-per-node 2 runbooks/drills/dataloader_straggler.py \\
        --stall-at-step 5 --stall-s 30 --timeout-s 3
Rank 0 also prints one summary line per --num-workers value, e.g.
    workers 0 | slowest data: rank 1 (data 70%) | longest all_reduce wait: rank 0 (comm 63%) | ...
"""

import argparse
import datetime
import faulthandler
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class SkewedDataset(Dataset):
    """Fast everywhere except on the rank that builds it with io_ms > 0."""

    def __init__(self, num_samples, dim, io_ms, stall_index, stall_s):
        self.num_samples, self.dim, self.io_ms = num_samples, dim, io_ms
        self.stall_index, self.stall_s = stall_index, stall_s
        self.features = torch.randn(num_samples, dim, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        time.sleep(self.io_ms / 1e3)
        if index == self.stall_index:
            time.sleep(self.stall_s)  # e.g. a shard fetched from a throttled bucket
        x = self.features[index]  # in memory: the only slow part is the simulated I/O
        return x, x.sum().sign()


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None):
    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-workers", type=int, nargs="+", default=[0],
                   help="DataLoader workers per rank; several values are measured in turn")
    p.add_argument("--slow-rank", type=int, default=1, help="the rank whose data is slow")
    p.add_argument("--io-ms", type=float, default=4.0, help="per-sample latency on --slow-rank")
    p.add_argument("--steps", type=int, default=16, help="steps per --num-workers value")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--dim", type=int, default=256, help="model width")
    p.add_argument("--stall-at-step", type=int, default=0,
                   help="--slow-rank blocks for --stall-s in this step's data (0: never)")
    p.add_argument("--stall-s", type=float, default=30.0, help="length of that stall, seconds")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="init_process_group(timeout=...): how long a collective may wait")
    p.add_argument("--json-out", default="", help="write every rank's measurements here (rank 0)")
    args = p.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 2:
        p.error("needs a world of >= 2 ranks (a straggler needs someone to wait for it): "
                "launch with torchrun --nproc-per-node 2")
    if not 0 <= args.slow_rank < world_size:
        p.error(f"--slow-rank must be in [0, {world_size}), got {args.slow_rank}")
    if min(args.num_workers) < 0:
        p.error(f"--num-workers must be >= 0, got {args.num_workers}")
    for name in ["batch_size", "dim", "timeout_s"]:
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (step 1 is warm-up and not measured), got {args.steps}")
    if not 0 <= args.stall_at_step <= args.steps or args.stall_s < 0 or args.io_ms < 0:
        p.error("--stall-at-step must be in [0, --steps]; --stall-s and --io-ms must be >= 0")
    return args


def init_distributed(timeout_s):
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def all_reduce_gradients(model, step, rank):
    """One flat all_reduce of every gradient: the collective that waits for the straggler."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if flat.is_cuda:
        torch.cuda.synchronize()  # NCCL runs on a stream: time the wait, not the launch
    t0 = time.perf_counter()
    try:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        if flat.is_cuda:
            torch.cuda.synchronize()
    except Exception as exc:
        # Name the collective and step: the backend's message (gloo: "Timed out waiting
        # ...ms for recv operation to complete") says neither.
        print(f"rank {rank}: all_reduce(gradients) at step {step} failed after "
              f"{time.perf_counter() - t0:.1f} s: {exc}", file=sys.stderr, flush=True)
        raise
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return time.perf_counter() - t0


def run(num_workers, args, model, optimizer, rank, world_size, device):
    slow = rank == args.slow_rank
    num_samples = args.batch_size * world_size * args.steps
    # The stall hits the first sample of --stall-at-step on the slow rank: with shuffle=False,
    # rank r reads indices r, r + world_size, r + 2 * world_size, ...
    stall_index = ((args.stall_at_step - 1) * args.batch_size * world_size + rank
                   if slow and args.stall_at_step else -1)
    dataset = SkewedDataset(num_samples, args.dim, args.io_ms if slow else 0.0, stall_index,
                            args.stall_s)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=num_workers, timeout=10 * args.timeout_s if num_workers else 0)
    totals = {"data": 0.0, "comm": 0.0, "step": 0.0}
    it = iter(loader)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = (t.to(device, non_blocking=True) for t in next(it))
        t_data = time.perf_counter() - t0
        loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
        loss.backward()
        t_comm = all_reduce_gradients(model, step, rank)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()  # only so the wall clock sees the kernels finish
        if step > 1:  # step 1 includes worker start-up; leave it out, as the labs do
            for key, value in (("data", t_data), ("comm", t_comm),
                               ("step", time.perf_counter() - t0)):
                totals[key] += value
    steps = args.steps - 1
    result = {"rank": rank, "num_workers": num_workers, "slow": slow,
              "step_ms": 1e3 * totals["step"] / steps,
              "data_share": totals["data"] / totals["step"],
              "comm_share": totals["comm"] / totals["step"]}
    print(f"rank {rank} | workers {num_workers} | step {result['step_ms']:.1f} ms | "
          f"data {result['data_share']:.0%} | comm {result['comm_share']:.0%}", flush=True)
    return result


def main(argv=None):
    args = parse_args(argv)
    # When torchrun stops the job it sends SIGTERM to the surviving ranks: print where each
    # one was (the straggler shows its data-loading frame), then die as SIGTERM would.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    rank, world_size, device = init_distributed(args.timeout_s)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(),
                              nn.Linear(4 * args.dim, args.dim), nn.GELU(),
                              nn.Linear(args.dim, 1)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        results = []
        for num_workers in args.num_workers:
            mine = run(num_workers, args, model, optimizer, rank, world_size, device)
            per_rank = [None] * world_size
            dist.all_gather_object(per_rank, mine)
            results.append(per_rank)
            if rank == 0:
                slowest = max(per_rank, key=lambda m: m["data_share"])
                waiting = max((m for m in per_rank if m is not slowest),
                              key=lambda m: m["comm_share"])
                print(f"workers {num_workers} | slowest data: rank {slowest['rank']} "
                      f"(data {slowest['data_share']:.0%}) | longest all_reduce wait: rank "
                      f"{waiting['rank']} (comm {waiting['comm_share']:.0%}) | step "
                      f"{max(m['step_ms'] for m in per_rank):.1f} ms", flush=True)
        if rank == 0 and args.json_out:
            with open(args.json_out + ".tmp", "w") as f:
                json.dump({"world_size": world_size, "args": vars(args), "results": results},
                          f, indent=2)
            os.replace(args.json_out + ".tmp", args.json_out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
