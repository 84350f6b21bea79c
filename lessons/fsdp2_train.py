"""fsdp1_train.py ported to FSDP2 (fully_shard): lesson 02 shows the diff. Runs on GPUs with
NCCL and on CPU with gloo (where it is executed in CI).

    torchrun --standalone --nproc-per-node 2 lessons/fsdp2_train.py OUT.pt [--param-dtype bfloat16]
"""

import argparse
import datetime
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

STEPS, BATCH, DIM = 10, 8, 64


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(4)], torch.nn.Linear(DIM, 1))


def batches(rank, world_size):
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        inputs = torch.randn(BATCH, DIM, generator=generator)
        yield inputs.chunk(world_size)[rank], inputs.sum(1, keepdim=True).chunk(world_size)[rank]


def main(args, device):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.param_dtype)
    model = build_model().to(device)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model:  # the auto-wrap policy, written out: one unit per Block
        if isinstance(block, Block):
            fully_shard(block, mp_policy=policy)  # FULL_SHARD = reshard_after_forward=True
    fully_shard(model, mp_policy=policy)  # the root: the rest of the parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after sharding: DTensors
    for inputs, targets in batches(rank, world_size):
        loss = F.mse_loss(model(inputs.to(device)).float(), targets.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # a collective: every rank calls it
    if rank == 0:
        torch.save(state, args.out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    main(parser.parse_args(), device)
    gc.collect()
    dist.destroy_process_group()
