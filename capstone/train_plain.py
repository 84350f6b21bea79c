"""The capstone's starting point: a plain, single-process training script. Port it.

Your task (docs/onboarding-exercises.md, "Capstone"): make a copy that runs under torchrun,
first with DDP, then with FSDP2 (`fully_shard`), and trains the same model on the same global
batches. Keep the command-line contract below; `python capstone/grade.py your_port.py` then
runs your port at 2 ranks and this script in one process, and compares them.

    python capstone/train_plain.py --out runs/plain

Contract (what the grader reads): `--out DIR` gets `losses.json` (the mean loss of each step's
global batch, a list of floats) and `checkpoint.pt` (the final model's state_dict, plain
tensors, saved once).
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

NUM_SAMPLES, NUM_FEATURES, NUM_CLASSES = 512, 16, 4


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (samples per step)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="init and data order")
    parser.add_argument("--out", required=True, help="where losses.json and checkpoint.pt go")
    return parser.parse_args(argv)


def make_dataset(seed):
    """Inputs and labels from a fixed random teacher: the same on every run and every rank."""
    generator = torch.Generator().manual_seed(seed + 1000)
    inputs = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=generator)
    teacher = torch.randn(NUM_FEATURES, NUM_CLASSES, generator=generator)
    return TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def build_model():
    return nn.Sequential(nn.Linear(NUM_FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, NUM_CLASSES))


def epoch_order(num_samples, seed, epoch):
    """This epoch's shuffle: a permutation seeded by seed + epoch (DistributedSampler's rule,
    so a port that uses it, and calls set_epoch, sees the same global batches)."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))


def train(args, reshuffle=True):
    """Train; return (losses, model). reshuffle=False repeats epoch 0's order every epoch (the
    grader uses it to recognise a port that forgot set_epoch)."""
    torch.manual_seed(args.seed)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset, losses = make_dataset(args.seed), []
    for epoch in range(args.epochs):
        order = epoch_order(len(dataset), args.seed, epoch if reshuffle else 0)
        loader = DataLoader(torch.utils.data.Subset(dataset, order.tolist()),
                            batch_size=args.batch_size, shuffle=False)
        for inputs, labels in loader:
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses, model


def save(out, losses, model):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "losses.json").write_text(json.dumps(losses))
    torch.save(model.state_dict(), out / "checkpoint.pt")


def main(argv=None):
    args = parse_args(argv)
    losses, model = train(args)
    save(args.out, losses, model)
    print(f"trained {len(losses)} steps, last loss {losses[-1]:.4f}, saved to {args.out}")


if __name__ == "__main__":
    main()
