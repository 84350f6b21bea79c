"""The course's reference 2-D port of capstone/train_transformer.py (the grader's known-good
final capstone): tensor parallel over "tp", FSDP2 over "dp", a sharded DCP checkpoint, resume.

    torchrun --standalone --nproc-per-node 4 tests/capstone/port_2d.py --out runs/lm2d --stop-at-step 6
    torchrun --standalone --nproc-per-node 4 tests/capstone/port_2d.py --out runs/lm2d
"""

import datetime
import gc
import json
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "capstone"))
from train_transformer import (build_model, global_batch, lr_at, make_dataset,  # noqa: E402
                               parse_args, read_losses, train_step, write_losses)

TP = 2  # "tp" is the inner axis: consecutive ranks, one node's fast links
TIMEOUT = datetime.timedelta(seconds=60)


def init_mesh(world_size):
    """A (dp, tp) mesh whose groups carry TIMEOUT: in torch 2.13 init_device_mesh's sub-groups
    do not inherit the default group's timeout (runbooks/collective-timeout.md)."""
    ranks = torch.arange(world_size).view(world_size // TP, TP)
    dp_groups = [row.tolist() for row in ranks.T]  # same tp position, one per dp replica
    tp_groups = [row.tolist() for row in ranks]
    dp_group, _ = dist.new_subgroups_by_enumeration(dp_groups, timeout=TIMEOUT)
    tp_group, _ = dist.new_subgroups_by_enumeration(tp_groups, timeout=TIMEOUT)
    return DeviceMesh.from_group([dp_group, tp_group], "cpu", mesh=ranks,
                                 mesh_dim_names=("dp", "tp"))


def parallelize(model, mesh):
    """TP inside each block (Megatron's split: heads and MLP width), then FSDP over "dp"."""
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()})
        block.attention.num_heads //= TP  # each rank computes its share of the heads
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])  # the root: embedding, final norm, output


def save_checkpoint(out, model, optimizer, step, rank):
    """Every rank writes its shards into checkpoint.tmp; rank 0 renames it once all are done."""
    model_state, optim_state = get_state_dict(model, optimizer)
    tmp, final = out / "checkpoint.tmp", out / "checkpoint"
    dcp.save({"model": model_state, "optim": optim_state, "step": step}, checkpoint_id=tmp)
    dist.barrier()  # dcp.save returns on each rank; all must be written before the rename
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()


def load_checkpoint(out, model, optimizer):
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": 0}
    dcp.load(state, checkpoint_id=out / "checkpoint")  # each rank reads the slices it holds
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return state["step"]


def run(args, rank, world_size):
    """Everything that holds the process group lives and dies in here (runbooks/exit-hang.md)."""
    mesh = init_mesh(world_size)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    model = build_model(args.seed)  # every rank builds the same full model, then keeps slices
    parallelize(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after sharding
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    done = load_checkpoint(out, model, optimizer) if (out / "checkpoint").exists() else 0
    losses = read_losses(out, done)
    dataset = make_dataset(args.seed)
    last = min(args.steps, args.stop_at_step or math.inf)
    for step in range(done + 1, last + 1):
        # The two tp ranks of a replica see the same sequences; the dp replicas split the batch.
        tokens = global_batch(dataset, step, args.batch_size, args.seed).chunk(dp_size)[dp_rank]
        loss = train_step(model, optimizer, tokens, lr_at(step, args))
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        losses.append(loss.item())  # the global batch's mean: equal shards, mean of means
    if rank == 0:
        write_losses(out, losses)
    save_checkpoint(out, model, optimizer, last, rank)


def main():
    args = parse_args()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    try:
        run(args, dist.get_rank(), dist.get_world_size())
    finally:
        gc.collect()  # models kept alive by reference cycles go before their group
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
