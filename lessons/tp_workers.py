"""Worker functions for lessons/03_tp_fsdp.py (each child process imports them by name).

Each runs inside a gloo process group started by spawn.run_workers and returns plain values.
The model, plans and mesh code come from labs/lab03_tp_fsdp.py, so the lesson studies the code
the lab runs.
"""

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "labs"))
import lab03_tp_fsdp as lab  # noqa: E402


class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; backward all-reduces the input gradient, because every
    rank's column slice contributed a part of dL/dx."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: forward all-reduces the row-parallel partial sums; backward is identity,
    because every rank needs the whole output gradient."""

    @staticmethod
    def forward(ctx, partial):
        out = partial.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


def column_row_by_hand(rank, world_size, dim=8, hidden=16):
    """MLP y = gelu(x A^T) B^T with A split by output features (column-parallel) and B by input
    features (row-parallel): one all-reduce forward, one backward. Compared with nn.Linear."""
    torch.manual_seed(0)  # the same full weights and input on every rank
    fc1 = torch.nn.Linear(dim, hidden, bias=False)
    fc2 = torch.nn.Linear(hidden, dim, bias=False)
    x = torch.randn(4, dim, requires_grad=True)
    fc2(F.gelu(fc1(x))).pow(2).sum().backward()  # the single-device reference

    cols = slice(rank * hidden // world_size, (rank + 1) * hidden // world_size)
    a = fc1.weight.detach()[cols].clone().requires_grad_()     # rows of A^T = its output features
    b = fc2.weight.detach()[:, cols].clone().requires_grad_()  # B's input features, same slice
    x_tp = x.detach().clone().requires_grad_()
    h = F.gelu(CopyToTP.apply(x_tp) @ a.t())  # local: no communication between the two matmuls
    y = ReduceFromTP.apply(h @ b.t())
    y.pow(2).sum().backward()
    return {"a_shape": tuple(a.shape), "b_shape": tuple(b.shape),
            "out_diff": (y - fc2(F.gelu(fc1(x)))).abs().max().item(),
            "x_grad_diff": (x_tp.grad - x.grad).abs().max().item(),
            "a_grad_diff": (a.grad - fc1.weight.grad[cols]).abs().max().item(),
            "b_grad_diff": (b.grad - fc2.weight.grad[:, cols]).abs().max().item()}


def show_placements(rank, world_size):
    """One 4x4 tensor under four placements on a (dp, tp) = (2, 2) mesh: what each rank holds."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(16.0).reshape(4, 4)
    layouts = {"(Replicate(), Replicate())": [Replicate(), Replicate()],
               "(Shard(0), Replicate())": [Shard(0), Replicate()],
               "(Replicate(), Shard(1))": [Replicate(), Shard(1)],
               "(Shard(0), Shard(1))": [Shard(0), Shard(1)]}
    local = {name: distribute_tensor(full, mesh, placements).to_local().tolist()
             for name, placements in layouts.items()}
    return {"coordinate": mesh.get_coordinate(), "local": local}


def lab_layout(rank, world_size, sequence_parallel):
    """The lab's model on a (2, 2) mesh: placements and local shapes, sharded and unsharded."""
    args = ["--tp", "2"] + (["--sequence-parallel"] if sequence_parallel else [])
    cfg = lab.parse_config(args)
    mesh = lab.build_mesh(cfg, world_size, torch.device("cpu"))
    model = lab.build_parallel_model(cfg, mesh, torch.device("cpu"))
    block = model.layers["0"]
    rows = {}
    for name, param in block.named_parameters():
        rows[name] = {"placements": str(param.placements), "global": tuple(param.shape),
                      "sharded_local": tuple(param.to_local().shape)}
    block.unshard()  # FSDP all-gather over dp: what the matmuls see
    for name, param in block.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        rows[name]["tp_placements"] = str(param.placements) if isinstance(param, DTensor) else "-"
        rows[name]["tp_local"] = tuple(local.shape)
    block.reshard()
    return {"mesh": mesh.get_coordinate(), "params": rows}


def plan_mistakes(rank, world_size):
    """What goes wrong with a root-level plan, the wrong order, and wrong mesh sizes (4 ranks)."""
    cfg = lab.parse_config(["--tp", "2"])
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    model = lab.build_model(cfg)
    with warnings.catch_warnings(record=True) as caught:  # block keys handed to the root
        warnings.simplefilter("always")
        parallelize_module(model, mesh["tp"], {"attention.wq": ColwiseParallel()})
    out["root_plan_warnings"] = [str(w.message)[:100] for w in caught]
    out["root_plan_wq_is_dtensor"] = isinstance(model.layers["0"].attention.wq.weight, DTensor)
    try:
        lab.check_plan_keys(model, {"attention.wq": ColwiseParallel()})
    except ValueError as exc:
        out["guard"] = str(exc)
    block = lab.build_model(cfg).layers["0"]
    fully_shard(block, mesh=mesh["dp"])  # FSDP first, then TP: the wrong order
    try:
        parallelize_module(block, mesh["tp"], lab.block_plan(cfg))
    except Exception as exc:  # noqa: BLE001  (we report whatever PyTorch raises)
        out["fsdp_then_tp"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    try:
        init_device_mesh("cpu", (world_size, 2), mesh_dim_names=("dp", "tp"))
    except RuntimeError as exc:
        out["mesh_too_big"] = str(exc)
    small = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))  # half the world
    out["small_mesh_coordinate"] = small.get_coordinate()
    return out


def tour_2d(rank, world_size):
    """The three 4-rank demos in one process group (one start-up instead of three)."""
    return {"placements": show_placements(rank, world_size),
            "layout": lab_layout(rank, world_size, False),
            "mistakes": plan_mistakes(rank, world_size)}
