"""Worker functions for lessons/02_fsdp.py (each child process imports them by name).

Each runs inside a gloo process group started by spawn.run_workers and returns plain data.
Model building and sharding come from labs/lab02_fsdp.py itself, the step and the byte probes
from its kit (labs/labkit/), so the lesson measures the code the lab runs.
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "labs"))
import lab02_fsdp as lab  # noqa: E402
from labkit.loop import train_step  # noqa: E402
from labkit.probes import (CommCounter, FirstStepBytes, SavedActivationBytes,  # noqa: E402
                           layout_report)

# The lab's loss scaler, disabled: these measurements run in fp32 or bf16, which need none.
FP32 = lab.make_grad_scaler(None, torch.device("cpu"))


def lab_step(model, optimizer, batches, cfg, device, amp_dtype):
    """One optimizer step as lab02 takes it: the kit's step with the lab's gradient sync."""
    return train_step(model, optimizer, FP32, batches, cfg, device, amp_dtype, lab.gradient_sync)


def _toy_problem(rank, world_size, steps):
    """A (6, 4) weight, one global batch of 4 samples per rank, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 4, generator=gen)
    inputs = torch.randn(steps, world_size, 4, 4, generator=gen)   # step, rank, sample, feature
    targets = torch.randn(steps, world_size, 4, 6, generator=gen)
    return weight, inputs, targets


def shard_by_hand_vs_fully_shard(rank, world_size, steps=3, lr=0.1):
    """Train one linear layer three ways and compare: (1) by hand: keep a row shard, all-gather
    it before use, reduce-scatter the gradient, update only the shard; (2) fully_shard;
    (3) one process on the whole global batch."""
    weight, inputs, targets = _toy_problem(rank, world_size, steps)

    # (1) By hand. This rank's shard: rows [rank * 6/N, (rank+1) * 6/N).
    shard = weight.chunk(world_size)[rank].clone()
    for step in range(steps):
        pieces = [torch.empty_like(shard) for _ in range(world_size)]
        dist.all_gather(pieces, shard)                      # all-gather: the full weight
        full = torch.cat(pieces).requires_grad_()
        loss = F.mse_loss(inputs[step, rank] @ full.T, targets[step, rank])
        loss.backward()                                     # full-size grad, local data only
        grad_shard = torch.empty_like(shard)
        dist.reduce_scatter(grad_shard, list(full.grad.chunk(world_size)))  # sum of my rows
        shard -= lr * grad_shard / world_size               # mean over ranks, then SGD
        del full                                            # the full weight is transient

    # (2) FSDP2 on the same layer, data and optimizer.
    layer = torch.nn.Linear(4, 6, bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    fully_shard(layer, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.SGD(layer.parameters(), lr=lr)
    for step in range(steps):
        F.mse_loss(layer(inputs[step, rank]), targets[step, rank]).backward()
        optimizer.step()
        optimizer.zero_grad()
    fsdp_shard = layer.weight.to_local().detach()

    # (3) One process, every rank's samples in one batch.
    single = weight.clone().requires_grad_()
    for step in range(steps):
        loss = F.mse_loss(inputs[step].flatten(0, 1) @ single.T, targets[step].flatten(0, 1))
        loss.backward()
        with torch.no_grad():
            single -= lr * single.grad
        single.grad = None
    return {"shard_shape": list(shard.shape), "fsdp_shard_shape": list(fsdp_shard.shape),
            "placements": str(layer.weight.placements),
            "by_hand_vs_fsdp": (shard - fsdp_shard).abs().max().item(),
            "by_hand_vs_single": (shard - single.detach().chunk(world_size)[rank]).abs().max().item()}


# What lesson 02 measures: the lab's builders, one optimizer step each, bytes each rank holds.
STRATEGY_ARGS = {
    "ddp": ["--strategy", "ddp"],
    "zero1": ["--strategy", "zero1"],
    # Not the estimator's (and DeepSpeed's) ZeRO-2, which keeps a full copy of the parameters
    # on every rank: here they are sharded between steps, and whole from a block's forward to
    # its backward.
    "fsdp_no_reshard": ["--strategy", "fsdp", "--reshard-after-forward", "false"],
    "zero3": ["--strategy", "fsdp"],
    "hsdp": ["--strategy", "fsdp", "--hsdp", "2"],
}


def mesh_axes(rank, world_size):
    """This rank's group on each axis: a 1-D mesh of every rank, and a 2 x (world_size / 2)
    mesh with axes ("dp_replicate", "dp_shard"), with its coordinate in the second."""
    flat = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    grid = init_device_mesh("cpu", (2, world_size // 2),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
    groups = {axis: dist.get_process_group_ranks(grid.get_group(axis))
              for axis in grid.mesh_dim_names}
    return {"dp": dist.get_process_group_ranks(flat.get_group("dp")), **groups,
            "coordinate": grid.get_coordinate()}


def measure_strategies(rank, world_size, names=tuple(STRATEGY_ARGS)):
    """For each strategy: bytes of params, grads and optimizer state this rank holds after one
    optimizer step, and bytes of full-size params held between forward and backward."""
    device, results = torch.device("cpu"), {}
    for name in names:
        args = STRATEGY_ARGS[name]
        cfg = lab.parse_config([*args, "--steps", "1"])
        torch.manual_seed(cfg.seed)
        model, optimizer, mesh = lab.build(cfg, world_size, device)
        if mesh:
            lab.inspect_fsdp(model, mesh, cfg)  # the lab's own asserts on what each rank holds
        layout = layout_report(model) if mesh else None
        probe = FirstStepBytes(model, optimizer)
        batches = lab.micro_batches(cfg, rank, world_size, 0)
        lab_step(model, optimizer, batches, cfg, device, None)
        results[name] = {**probe.values, "layout": layout and layout["layers.0.attention.wq.weight"]}
        del model, optimizer
    results["param_shapes"] = [list(p.shape) for p in lab.build_model(cfg).parameters()]
    return results


def fsdp_step_trace(rank, world_size):
    """One FSDP step of the lab model (after a warm-up step that builds FSDP's buffers), under
    torch.profiler. FSDP2 labels each phase with record_function ("FSDP::all_gather (layers.0)",
    "FSDP::post_backward_reduce (layers.1)", ...). Returns this rank's labelled intervals in ms
    from the step's start (step_phases turns them into bars), and the bytes it sent per
    collective (labkit's CommCounter: ring factors, lesson 00), next to the bytes DDP's all-reduce of the same gradients would send."""
    cfg = lab.parse_config(["--steps", "1"])
    torch.manual_seed(cfg.seed)
    model, optimizer, mesh = lab.build(cfg, world_size, torch.device("cpu"))
    batches = lab.micro_batches(cfg, rank, world_size, 0)
    lab_step(model, optimizer, batches, cfg, torch.device("cpu"), None)  # warm-up
    counter = CommCounter({"dp": mesh.get_group(), "world": dist.group.WORLD})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with counter:
            lab_step(model, optimizer, batches, cfg, torch.device("cpu"), None)
    events = [(e.name, e.time_range.start / 1e3, e.time_range.end / 1e3) for e in prof.events()
              if e.name.startswith("FSDP::") or e.name.startswith("gloo:")]
    t0 = min(start for _, start, _ in events)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())  # global numel of each DTensor
    return {"events": [(name, start - t0, end - t0) for name, start, end in events],
            "wire_bytes": dict(counter.wire_bytes),
            "ddp_wire_bytes": 2 * (world_size - 1) / world_size * grad_bytes,
            "root_param_bytes": sum(p.numel() * 4 for n, p in model.named_parameters()
                                    if not n.startswith("layers.")),
            "param_bytes": grad_bytes}



def _unit_of(name):
    """"FSDP::all_gather (layers.0)" -> "layers.0"; unlabelled or "()" -> the root."""
    inside = name.rsplit("(", 1)[1].rstrip(")") if name.endswith(")") else ""
    return inside or ("layers." + name.rsplit(".", 1)[1] if " for layers." in name else "root")


def step_phases(events, blocks=("layers.0", "layers.1")):
    """The phases of one FSDP step, from fsdp_step_trace's events (FSDP2's record_function
    labels, with their start and end in ms): a list of (unit, phase, start, end) bars, one per
    thing FSDP did to a unit. unit is "root" or a block ("layers.0", ...); phase is one of
    - "all-gather", or "all-gather (prefetch)" when FSDP issued it ahead of its block, inside
      another unit's backward_prefetch;
    - "forward" and "backward": a block's compute, between FSDP's hooks of that block;
    - "free": a block's gathered parameters resharded after use (the root is kept whole from
      forward to the end of backward, so it has none);
    - "reduce-scatter": the unit's gradients, once its backward is done."""
    spans = {}
    for name, start, end in events:
        spans.setdefault(name, []).append((start, end))
    prefetch = [(s, e) for name, ss in spans.items() if "backward_prefetch" in name for s, e in ss]
    bars = []
    for name, start, end in events:
        if not name.startswith("FSDP::"):
            continue
        unit, kind = _unit_of(name), name.split("::")[1].split(" ")[0]
        if kind == "all_gather":
            early = any(s <= start and end <= e for s, e in prefetch)
            bars.append((unit, "all-gather (prefetch)" if early else "all-gather", start, end))
        elif kind == "post_backward_reduce":
            bars.append((unit, "reduce-scatter", start, end))
        elif kind in ("post_forward", "post_backward_reshard") and unit != "root":
            bars.append((unit, "free", start, end))
    for unit in blocks:  # compute: between FSDP's hooks of that block
        (_, fwd_start), = spans[f"FSDP::pre_forward ({unit})"]
        (fwd_end, _), = spans[f"FSDP::post_forward ({unit})"]
        (_, bwd_start), = spans[f"FSDP::pre_backward ({unit})"]
        (bwd_end, _), = spans[f"FSDP::post_backward_accumulate ({unit})"]
        bars += [(unit, "forward", fwd_start, fwd_end), (unit, "backward", bwd_start, bwd_end)]
    return bars


# The flags a lab02 user reaches for, one row each (lesson 02's table).
FLAG_ROWS = {
    "fp32 (default)": [],
    # --mixed-precision auto follows --amp: fp32 here keeps this row autocast alone.
    "--amp bf16 --mixed-precision fp32": ["--amp", "bf16", "--mixed-precision", "fp32"],
    "--mixed-precision bf16": ["--mixed-precision", "bf16"],
    "--activation-checkpointing": ["--activation-checkpointing"],
    "--cpu-offload": ["--cpu-offload"],
    "--compile": ["--compile"],
}


def flag_matrix_row(rank, world_size, label, timed_steps=5):
    """One row of lab02 flags (FLAG_ROWS, or flags given as the label): the bytes this rank
    holds after a step, the bytes it sends per step (per mesh axis), the activations autograd
    saves, the dtypes inside forward, the first step's time (compilation, for --compile) and
    the median of the next steps. One row per set of processes: a second mesh over the same
    ranks would reuse the first one's groups, and the counter must know every group."""
    device = torch.device("cpu")
    cfg = lab.parse_config([*FLAG_ROWS.get(label, label.split()), "--steps", "1"])
    torch.manual_seed(cfg.seed)
    model, optimizer, mesh = lab.build(cfg, world_size, device)
    amp = lab.compute_dtype(cfg, "cpu")
    batches = lab.micro_batches(cfg, rank, world_size, 0)
    seen = {}
    hook = model.layers["0"].feed_forward.w1.register_forward_hook(
        lambda mod, args, out: seen.update(weight=str(mod.weight.dtype)[6:],
                                           activation=str(out.dtype)[6:]))
    t0 = time.perf_counter()
    lab_step(model, optimizer, batches, cfg, device, amp)  # compiles, if asked
    first_s = time.perf_counter() - t0
    hook.remove()
    groups = {name: mesh.get_group(name) for name in mesh.mesh_dim_names}
    counter = CommCounter({**groups, "world": dist.group.WORLD})
    saved, probe = SavedActivationBytes(model), FirstStepBytes(model, optimizer)
    with counter, saved:
        lab_step(model, optimizer, batches, cfg, device, amp)
    times = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        lab_step(model, optimizer, batches, cfg, device, amp)
        times.append(time.perf_counter() - t0)
    return {"state": {k: probe.values[k] for k in ("params", "grads", "optimizer")},
            "wire_bytes": dict(counter.wire_bytes),
            "wire_bytes_by_group": dict(counter.wire_bytes_by_group),
            "saved_activation_bytes": saved.total, "dtypes": seen,
            "sharded_param_dtype": str(next(model.parameters()).dtype)[6:],
            "first_step_s": first_s, "step_s": sorted(times)[len(times) // 2]}


def fsdp1_refuses_cpu(rank, world_size):
    """FSDP1 (FullyShardedDataParallel) on a CPU-only machine: the error its constructor raises."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        FullyShardedDataParallel(torch.nn.Linear(4, 4))
    except RuntimeError as exc:
        return str(exc)
    return None
