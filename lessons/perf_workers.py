"""Worker functions for lessons/06_performance.py (run with spawn.run_workers).

Training steps of the lab model under torch.profiler, with DDP or with FSDP2 over gloo.
Returned per rank: the intervals where this process computed (aten ops on the training
thread) and where gloo communicated (its "gloo:*" events, which run on gloo's own threads),
so the lesson can draw them and measure how much of the communication ran during compute.
"""

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

import lab01_ddp as lab
from labkit.model import loss_fn


def build(strategy, dim, num_layers):
    """strategy: "ddp", "fsdp" (FSDP2's defaults) or "fsdp-async" (FSDP2 with its all-gathers
    issued async_op=True and each block prefetching the next, explicitly)."""
    cfg = lab.parse_config(["--dim", str(dim), "--num-heads", str(max(4, dim // 64)),
                            "--num-layers", str(num_layers), "--seq-len", "64",
                            "--micro-batch-size", "4", "--amp", "off"])
    torch.manual_seed(0)
    model = lab.build_model(cfg)
    if strategy == "ddp":
        # Small buckets, so that several all-reduces can start while backward goes on.
        model = DDP(model, bucket_cap_mb=1)
    else:
        blocks = list(model.layers.values())
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        if strategy == "fsdp-async":
            # Private API, on purpose: FSDP2 overlaps with CUDA streams, and on CPU there are
            # none. async_op=True hands the all-gather to gloo's thread and returns; explicit
            # prefetching then starts block k+1's gather before block k computes.
            model._set_unshard_async_op(True)
            for block, after in zip(blocks, blocks[1:]):
                block.set_modules_to_forward_prefetch([after])
                after.set_modules_to_backward_prefetch([block])
    return cfg, model


MARKERS = ("c10d::", "FSDP::", "autograd::engine::evaluate_function:")


def intervals(prof):
    """(kind, name, start_s, end_s): "compute" (aten ops on the training thread), "comm"
    (gloo's collectives, on gloo's threads) and "marker" (what the training thread did in
    order: the c10d calls that issue collectives, FSDP's phases, autograd's backward nodes).
    The profiler numbers threads itself; the training thread is the one that ran the aten
    ops (on CPU, autograd runs backward on the thread that called it)."""
    events = prof.events()
    training_thread = Counter(e.thread for e in events if e.name.startswith("aten::"))
    training_thread = training_thread.most_common(1)[0][0]
    out = []
    for e in events:
        start, end = e.time_range.start / 1e6, e.time_range.end / 1e6
        if e.name.startswith("gloo:"):
            out.append(("comm", e.name, start, end))
        elif e.thread != training_thread:
            continue
        elif e.name.startswith("aten::"):
            out.append(("compute", e.name, start, end))
        elif e.name.startswith(MARKERS):
            out.append(("marker", e.name, start, end))
    return out


def profiled_steps(rank, world_size, strategies, dim, num_layers=4):
    """{strategy: intervals} for one profiled step of each strategy, in one process group
    (one start-up of the ranks for all of them)."""
    return {strategy: profiled_step(strategy, dim, num_layers) for strategy in strategies}


def profiled_step(strategy, dim, num_layers):
    cfg, model = build(strategy, dim, num_layers)
    rank = dist.get_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (4, 65), generator=torch.Generator().manual_seed(rank))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()  # warm-up: buckets built, buffers allocated
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return intervals(prof)


# What the overlap cell asserts: the order in which the training thread did things, which no
# load on the machine can change (how much of gloo's time overlapped compute is printed beside).
def allreduces_issued_during_backward(events):
    """(all-reduces issued before the last backward node began, all-reduces issued). DDP's
    reducer issues a bucket's all-reduce from the autograd hook that fills the bucket's last
    gradient, so every bucket but the last (the embedding's, whose gradient comes last) is
    issued while backward still has work to do."""
    backward = [start for kind, name, start, _ in events
                if kind == "marker" and name.startswith("autograd::engine::evaluate_function:")]
    issued = [start for kind, name, start, _ in events
              if kind == "marker" and name == "c10d::allreduce_"]
    return sum(start < max(backward) for start in issued), len(issued)


def prefetched_in_forward(events, num_layers):
    """For blocks 1..num_layers-1: was the block's all-gather issued before the previous
    block's forward ended? That is what forward prefetching means; FSDP2's default on CPU
    gathers a block only when the block is about to run."""
    first = {}
    for kind, name, start, _ in sorted(events, key=lambda event: event[2]):
        if kind == "marker":
            first.setdefault(name, start)  # forward's occurrence comes first
    return [first[f"FSDP::all_gather (layers.{k})"] < first[f"FSDP::post_forward (layers.{k - 1})"]
            for k in range(1, num_layers)]
