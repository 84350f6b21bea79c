"""The course's reference FSDP2 port of capstone/train_plain.py (the grader's known-good port).

    torchrun --standalone --nproc-per-node 2 tests/capstone/port_fsdp2.py --out runs/fsdp2
"""

import datetime
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "capstone"))
from train_plain import build_model, make_dataset, parse_args  # noqa: E402


def run(args, rank, world_size):
    """Everything that holds the process group lives and dies in here (runbooks/exit-hang.md)."""
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    model = build_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after fully_shard
    dataset = make_dataset(args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size // world_size, sampler=sampler)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            logged = loss.detach().clone()
            dist.all_reduce(logged, op=dist.ReduceOp.AVG)  # the global batch's mean
            losses.append(logged.item())
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # a collective: every rank
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "losses.json").write_text(json.dumps(losses))
        torch.save(state, out / "checkpoint.pt")


def main():
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        run(args, dist.get_rank(), dist.get_world_size())
    finally:
        gc.collect()  # models kept alive by reference cycles go before their group
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
