"""train_plain.py with DDP: lesson 01 shows the diff and checks that both train the same model.

    torchrun --standalone --nproc-per-node 2 lessons/train_ddp.py OUT.pt
"""

import datetime
import gc
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BATCH, EPOCHS = 32, 3


def make_dataset(num_samples=512):
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(num_samples, 16, generator=generator)
    labels = (inputs[:, :4].sum(dim=1) > 0).long()  # a rule the model can learn
    return TensorDataset(inputs, labels)


def main(out_path):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    model = DDP(model)  # broadcasts rank 0's weights; all-reduces gradients in backward
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = make_dataset()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=BATCH // world_size, sampler=sampler)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)  # a new order every epoch, the same on every rank
        for inputs, labels in loader:
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}")
    if rank == 0:
        torch.save(model.module.state_dict(), out_path)  # .module: no "module." key prefix


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # nccl on GPUs
    main(sys.argv[1])  # the DDP model lives in here; it holds the process group, so it must
    gc.collect()  # be gone (cycles included) before the group is (runbooks/exit-hang.md, D)
    dist.destroy_process_group()
