"""The course's reference DDP port of capstone/train_plain.py (the grader's known-good port).

    torchrun --standalone --nproc-per-node 2 tests/capstone/port_ddp.py --out runs/ddp
"""

import datetime
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "capstone"))
from train_plain import build_model, make_dataset, parse_args  # noqa: E402


def run(args, rank, world_size):
    """Everything that holds the process group lives and dies in here (runbooks/exit-hang.md)."""
    torch.manual_seed(args.seed)
    model = DDP(build_model())  # DDP also broadcasts rank 0's weights at the start
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset = make_dataset(args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size // world_size, sampler=sampler)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            optimizer.step()
            optimizer.zero_grad()
            logged = loss.detach().clone()
            dist.all_reduce(logged, op=dist.ReduceOp.AVG)
            losses.append(logged.item())
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "losses.json").write_text(json.dumps(losses))
        torch.save(model.module.state_dict(), out / "checkpoint.pt")
    dist.barrier()  # nobody tears down while rank 0 writes


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
