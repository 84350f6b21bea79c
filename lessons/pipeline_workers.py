"""Worker functions for lessons/04_pipeline.py (run with spawn.run_workers).

A two-stage pipeline by hand: rank 0 holds the first half of a small MLP, rank 1 the second
half and the loss. Activations go forward with dist.send / dist.recv, gradients come back the
same way. GPipe order: all forwards, then all backwards.
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DIM, HIDDEN, CLASSES = 256, 1024, 4  # wide enough that compute, not messaging, shows


def build_halves(seed=0):
    """The whole model, cut in two. Both ranks build both halves from one seed, so every rank
    (and the single-process check) starts from the same weights."""
    torch.manual_seed(seed)
    first = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU())
    second = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    return first, second


def make_batch(batch_size, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, DIM, generator=generator)
    y = torch.randint(0, CLASSES, (batch_size,), generator=generator)
    return x, y


def gpipe_by_hand(rank, world_size, batch_size, num_microbatches):
    """One training step of a 2-stage GPipe pipeline. Returns this rank's parameter gradients,
    the loss (rank 1) and when each forward / backward computed, as (kind, mb, start, end) in
    seconds on a clock both ranks share: the machine's monotonic clock, from the earlier of the
    two ranks' starts. A start is stamped after the receive it waits on, so waiting shows as a
    gap, not as work, and a stage never starts a microbatch before its sender finished it."""
    assert world_size == 2, "this demo has exactly two stages"
    first, second = build_halves()
    module = first if rank == 0 else second
    x, y = make_batch(batch_size)
    xs, ys = x.chunk(num_microbatches), y.chunk(num_microbatches)
    saved, events, losses = [], [], []
    # Warm-up, untimed: the first backward in a process pays a one-off set-up (180 ms here),
    # which would swamp the step. Its gradients are thrown away.
    warm_input = xs[0] if rank == 0 else torch.zeros(xs[0].shape[0], HIDDEN)
    warm_output = module(warm_input)
    warm_output.backward(torch.ones_like(warm_output))  # the same kind of call as below
    module.zero_grad(set_to_none=True)
    # perf_counter is CLOCK_MONOTONIC, one clock for every process on this machine: t = 0 is
    # the earlier rank's start, whatever delay a busy machine puts between the two.
    dist.barrier()
    t0 = torch.tensor([time.perf_counter()], dtype=torch.float64)
    dist.all_reduce(t0, op=dist.ReduceOp.MIN)
    t0 = t0.item()
    for mb in range(num_microbatches):  # forward of every microbatch
        if rank == 0:
            start = time.perf_counter() - t0
            out = module(xs[mb])
            end = time.perf_counter() - t0
            dist.send(out.detach(), dst=1)  # the only traffic: one activation tensor
            saved.append((out, None))
        else:
            inp = torch.empty(xs[mb].shape[0], HIDDEN)
            dist.recv(inp, src=0)
            start = time.perf_counter() - t0  # after the receive: waiting is not work
            inp.requires_grad_(True)  # so backward produces d loss / d input for rank 0
            loss = F.cross_entropy(module(inp), ys[mb]) / num_microbatches
            losses.append(loss.item())
            saved.append((loss, inp))
            end = time.perf_counter() - t0
        events.append(("F", mb, start, end))
    for mb in range(num_microbatches):  # backward of every microbatch
        out, inp = saved[mb]
        if rank == 1:
            start = time.perf_counter() - t0
            out.backward()  # accumulates into the parameters' .grad, fills inp.grad
            end = time.perf_counter() - t0
            dist.send(inp.grad, dst=0)  # the gradient goes back the way the activation came
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=1)
            start = time.perf_counter() - t0
            out.backward(grad)  # continue the chain rule from the received gradient
            end = time.perf_counter() - t0
        events.append(("B", mb, start, end))
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return {"grads": grads, "loss": sum(losses), "events": events}


def single_process_grads(batch_size):
    """The same step without a pipeline: whole batch, whole model, one process."""
    first, second = build_halves()
    x, y = make_batch(batch_size)
    loss = F.cross_entropy(second(first(x)), y)
    loss.backward()
    return ({name: p.grad for name, p in first.named_parameters()},
            {name: p.grad for name, p in second.named_parameters()}, loss.item())
