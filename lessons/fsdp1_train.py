"""An FSDP1 training script, the way many projects still have it: lesson 02 ports it to FSDP2
(fsdp2_train.py) and shows the diff. FSDP1 is deprecated, and needs an accelerator: on a
CPU-only machine its constructor raises. GPU only, not executed in CI.

    torchrun --standalone --nproc-per-node 2 lessons/fsdp1_train.py OUT.pt [--param-dtype bfloat16]
"""

import argparse
import datetime
import functools
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

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


def main(args):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.param_dtype)
    model = FSDP(build_model().cuda(),
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={Block}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32),
                 device_id=torch.cuda.current_device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for inputs, targets in batches(rank, world_size):
        loss = F.mse_loss(model(inputs.cuda()).float(), targets.cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()  # a collective: every rank calls it
    if rank == 0:
        torch.save(state, args.out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
    main(parser.parse_args())
    gc.collect()
    dist.destroy_process_group()
