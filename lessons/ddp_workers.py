"""Worker functions for lessons/01_ddp.py (each child process imports them by name).

Each runs inside a gloo process group started by spawn.run_workers and returns plain numbers.
The model and data come from the lab itself, so the lesson studies the code it runs.
"""

import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "labs"))
import lab01_ddp as lab  # noqa: E402
from labkit.data import SyntheticSequences  # noqa: E402
from labkit.model import loss_fn  # noqa: E402

LAB_DEFAULTS = lab.parse_config([])  # the lab's default model and data sizes


def _model():
    model = lab.build_model(LAB_DEFAULTS)
    model.init_weights(seed=0)
    return model


def _global_batch(size=16):
    data = SyntheticSequences(size, LAB_DEFAULTS.seq_len, LAB_DEFAULTS.vocab_size, seed=0)
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
    loss_fn(manual(inputs[mine]), targets[mine]).backward()
    for param in manual.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)  # the one collective DDP relies on
        param.grad /= world_size

    ddp = DDP(_model())
    loss_fn(ddp(inputs[mine]), targets[mine]).backward()  # DDP all-reduces in backward

    whole = _model()
    loss_fn(whole(inputs), targets).backward()
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
                (loss_fn(model(x), y) / micro_steps).backward()
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
            loss_fn(ddp(mine[0]), mine[1]).backward()
        sizes[label] = list(calls)
    return {"sizes": sizes, "first_bucket_cap": dist._DEFAULT_FIRST_BUCKET_BYTES}


# ---------------------------------------------------------------- what DDP users run into
class TwoBranches(torch.nn.Module):
    """A model with a branch that forward never uses (a frozen head, an if on the input)."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def unused_parameters(rank, world_size, find_unused, detail=False):
    """Two steps of a model with an unused branch. Without find_unused_parameters, DDP waits
    for gradients that never come, and the *next* forward raises."""
    if detail:  # what TORCH_DISTRIBUTED_DEBUG=DETAIL sets: the error then names parameters
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    torch.manual_seed(0)
    model = DDP(TwoBranches(), find_unused_parameters=find_unused)
    try:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
    except RuntimeError as exc:
        lines = str(exc).splitlines()
        named = [line for line in lines if line.startswith("Parameters which did not receive")]
        return {"error": lines[0], "named": named[0] if named else None}
    return {"error": None, "named": None}


def batchnorm_buffers(rank, world_size, forward_sync_buffers):
    """BatchNorm's running mean after 3 steps on each rank's own data, with and without DDP's
    buffer broadcast at each forward (`forward_sync_buffers`, torch 2.13's name for the
    deprecated `broadcast_buffers`); and the statistic SyncBatchNorm would use (GPU only),
    done by hand: one all-reduce of the batch mean, against one process on the whole batch."""
    torch.manual_seed(0)
    batches = [torch.randn(8, 4) + 3 * r for r in range(world_size)]  # ranks see different data
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)),
                forward_sync_buffers=forward_sync_buffers)
    for _ in range(3):
        model(batches[rank]).sum().backward()
    mean = model.module[1].running_mean.clone()
    gathered = [torch.zeros_like(mean) for _ in range(world_size)]
    dist.all_gather(gathered, mean)
    # By hand, the synchronised statistic: the mean over every rank's samples, one all-reduce.
    hidden = model.module[0](batches[rank]).detach()
    batch_mean = hidden.mean(0)
    dist.all_reduce(batch_mean)
    batch_mean /= world_size
    whole = model.module[0](torch.cat(batches)).detach().mean(0)
    return {"running_mean_per_rank": torch.stack(gathered),
            "sync_by_hand_vs_whole_batch": (batch_mean - whole).abs().max().item()}


def uneven_inputs(rank, world_size, use_join):
    """Rank r has 3 + 2r batches. Without Join the ranks with more batches wait in an all-reduce
    that the others never start; Join shadows the missing all-reduces for ranks that are done."""
    from torch.distributed.algorithms.join import Join

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    batches = [torch.randn(2, 4) for _ in range(3 + 2 * rank)]
    steps, start = 0, time.perf_counter()
    try:
        with Join([model]) if use_join else contextlib.nullcontext():
            for batch in batches:
                model(batch).sum().backward()
                steps += 1
    except RuntimeError as exc:
        return {"steps": steps, "error": str(exc).splitlines()[0][:160],
                "seconds": time.perf_counter() - start}
    return {"steps": steps, "error": None, "seconds": time.perf_counter() - start}


def compressed_allreduce_bytes(rank, world_size, hook_name):
    """Bytes DDP hands to all_reduce in one backward: the stock hook (fp32 buckets) against
    bf16_compress_hook (a bf16 copy of each bucket, decompressed after the sum)."""
    sent = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        sent.append((str(tensor.dtype), tensor.numel() * tensor.element_size()))
        return real_all_reduce(tensor, *args, **kwargs)

    model = DDP(_model())
    hook = {"allreduce": default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook}[hook_name]
    model.register_comm_hook(dist.group.WORLD, hook)
    inputs, targets = _global_batch(4 * world_size)
    dist.all_reduce = recording_all_reduce  # the hooks call torch.distributed.all_reduce
    try:
        loss_fn(model(inputs.chunk(world_size)[rank]), targets.chunk(world_size)[rank]).backward()
    finally:
        dist.all_reduce = real_all_reduce
    return {"sent": sent, "grad_bytes": sum(p.numel() * 4 for p in model.parameters())}
