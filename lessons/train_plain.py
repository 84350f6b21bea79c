"""A plain single-process training loop: lesson 01 turns it into train_ddp.py.

    python lessons/train_plain.py OUT.pt
"""

import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

BATCH, EPOCHS = 32, 3


def make_dataset(num_samples=512):
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(num_samples, 16, generator=generator)
    labels = (inputs[:, :4].sum(dim=1) > 0).long()  # a rule the model can learn
    return TensorDataset(inputs, labels)


def main(out_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = make_dataset()
    order = torch.Generator()
    loader = DataLoader(data, batch_size=BATCH, sampler=RandomSampler(data, generator=order))
    for epoch in range(EPOCHS):
        order.manual_seed(epoch)  # a new order every epoch, reproducibly
        for inputs, labels in loader:
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}")
    torch.save(model.state_dict(), out_path)


if __name__ == "__main__":
    main(sys.argv[1])
