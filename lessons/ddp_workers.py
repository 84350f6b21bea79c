"""Worker functions for lessons/01_ddp.py (they must be importable for the spawn start method).

Each runs inside a gloo process group started by spawn.run_workers and returns plain numbers.
The model and data come from the lab itself, so the lesson studies the code it runs.
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "labs"))
import lab01_ddp as lab  # noqa: E402

LAB_DEFAULTS = lab.parse_config([])  # the lab's default model and data sizes


def _model():
    model = lab.build_model(LAB_DEFAULTS)
    model.init_weights(seed=0)
    return model


def _global_batch(size=16):
    data = lab.SyntheticSequences(size, LAB_DEFAULTS.seq_len, LAB_DEFAULTS.vocab_size, seed=0)
    inputs, targets = zip(*(data[i] for i in range(size)))
    return torch.stack(inputs), torch.stack(targets)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def average_gradients_by_hand(rank, world_size):
    """Each rank: backward on its slice of the batch, then all_reduce(SUM) / world_size.
    Compare with (a) DDP on the same slices and (b) one process on the whole batch."""
    inputs, targets = _global_batch()
    mine = slice(rank * len(inputs) // world_size, (rank + 1) * len(inputs) // world_size)

    manual = _model()
    lab.loss_fn(manual(inputs[mine]), targets[mine]).backward()
    for param in manual.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)  # the one collective DDP relies on
        param.grad /= world_size

    ddp = DDP(_model())
    lab.loss_fn(ddp(inputs[mine]), targets[mine]).backward()  # DDP all-reduces in backward

    whole = _model()
    lab.loss_fn(whole(inputs), targets).backward()
    return {
        "manual_vs_ddp": (_grads(manual) - _grads(ddp.module)).abs().max().item(),
        "manual_vs_whole_batch": (_grads(manual) - _grads(whole)).abs().max().item(),
        "grad_bytes": _grads(manual).numel() * 4,
    }


def count_buckets(rank, world_size, bucket_cap_mb, micro_steps, use_no_sync, timed_steps=20):
    """Train a few steps with a comm hook that records every all-reduce DDP launches."""
    calls = []

    def recording_hook(state, bucket):
        calls.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)  # the stock behaviour, unchanged

    model = DDP(_model(), bucket_cap_mb=bucket_cap_mb)
    model.register_comm_hook(None, recording_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = _global_batch(4 * micro_steps * world_size)
    per_rank = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
    micro = list(zip(per_rank[0].chunk(micro_steps), per_rank[1].chunk(micro_steps)))
    step_times = []
    for step in range(timed_steps + 1):
        t0 = time.perf_counter()
        for i, (x, y) in enumerate(micro):
            skip_sync = use_no_sync and i < micro_steps - 1
            with model.no_sync() if skip_sync else torch.enable_grad():
                (lab.loss_fn(model(x), y) / micro_steps).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            first_step_buckets = list(calls)  # step 0 also builds the bucket order
        step_times.append(time.perf_counter() - t0)
    return {"buckets_first_step": first_step_buckets,
            "allreduce_calls_per_step": (len(calls) - len(first_step_buckets)) / timed_steps,
            "ms_per_step": 1e3 * sorted(step_times[1:])[len(step_times) // 2]}


def bucket_sizes_default_vs_explicit_cap(rank, world_size, dim=256):
    """The bytes of each all-reduce in one steady-state backward, for DDP's default
    bucket_cap_mb (None: 25 MiB, but the first bucket capped at dist._DEFAULT_FIRST_BUCKET_BYTES)
    and for an explicit bucket_cap_mb=25 (every bucket 25 MiB)."""
    cfg = lab.parse_config(["--dim", str(dim)])
    inputs, targets = _global_batch(4 * world_size)
    mine = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
    sizes = {}
    for label, cap in (("default", None), ("explicit 25", 25)):
        model = lab.build_model(cfg)
        model.init_weights(seed=0)
        ddp = DDP(model) if cap is None else DDP(model, bucket_cap_mb=cap)
        calls = []

        def recording_hook(state, bucket):
            calls.append(bucket.buffer().numel() * bucket.buffer().element_size())
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, recording_hook)
        for _ in range(2):  # step 1 learns the gradient order; buckets are rebuilt after it
            calls.clear()
            lab.loss_fn(ddp(mine[0]), mine[1]).backward()
        sizes[label] = list(calls)
    return {"sizes": sizes, "first_bucket_cap": dist._DEFAULT_FIRST_BUCKET_BYTES}
