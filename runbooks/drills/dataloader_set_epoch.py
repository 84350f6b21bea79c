"""Drill: a forgotten DistributedSampler.set_epoch (runbook dataloader-same-order-every-epoch).

DistributedSampler shuffles with a generator seeded by seed + epoch, and epoch only changes
when you call set_epoch. Forget it and every epoch replays the first epoch's permutation on
every rank. Nothing fails; the loss curve just repeats its shape each epoch. This drill builds
the samplers of a --world-size job in one process (a sampler only needs num_replicas and rank)
and runs the check a training loop can run too: fingerprint each epoch's index order.

    python runbooks/drills/dataloader_set_epoch.py --mode forgot   # exit 1: same order detected
    python runbooks/drills/dataloader_set_epoch.py --mode fixed    # exit 0
Output lines look like:
    forgot | rank 0 | epoch 1 | sampler.epoch 0 | order 4bcfa1b5 | first [12, 25, 19, 9]
    SAME ORDER: rank 0 epochs 0 and 1 read the data in the identical order (set_epoch not called?)
"""

import argparse
import hashlib
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def order_fingerprint(indices):
    """A short hash of an index order: equal fingerprints mean an identical epoch."""
    return hashlib.sha1(",".join(map(str, indices)).encode()).hexdigest()[:8]


def epoch_orders(mode, world_size, num_samples, num_epochs, batch_size, seed):
    """Each rank's per-epoch order of sample indices, as its DataLoader delivers them."""
    dataset = TensorDataset(torch.arange(num_samples))
    orders = {}
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=seed)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        for epoch in range(num_epochs):
            if mode == "fixed":
                sampler.set_epoch(epoch)  # before iter(loader): the order is drawn there
            indices = [int(i) for (batch,) in loader for i in batch]
            orders[rank, epoch] = indices
            print(f"{mode} | rank {rank} | epoch {epoch} | sampler.epoch {sampler.epoch} | "
                  f"order {order_fingerprint(indices)} | first {indices[:4]}", flush=True)
    return orders


def check_orders(orders, world_size, num_epochs, num_samples):
    """The check: no epoch may repeat the previous one, and each epoch must still cover the
    dataset across ranks exactly once (padding aside). Returns the problems found."""
    problems = []
    for rank in range(world_size):
        for epoch in range(1, num_epochs):
            if orders[rank, epoch] == orders[rank, epoch - 1]:
                problems.append(f"SAME ORDER: rank {rank} epochs {epoch - 1} and {epoch} read the "
                                f"data in the identical order (set_epoch not called?)")
    for epoch in range(num_epochs):
        seen = set().union(*(orders[r, epoch] for r in range(world_size)))
        if len(seen) != num_samples:
            problems.append(f"COVERAGE: epoch {epoch} saw {len(seen)} of {num_samples} samples")
    return problems


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None):
    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["forgot", "fixed"], default="forgot",
                   help="forgot: never call set_epoch; fixed: set_epoch(epoch) every epoch")
    p.add_argument("--world-size", type=int, default=2, help="ranks to simulate")
    p.add_argument("--num-samples", type=int, default=32, help="dataset size")
    p.add_argument("--num-epochs", type=int, default=3, help="epochs to run")
    p.add_argument("--batch-size", type=int, default=4, help="samples per batch per rank")
    p.add_argument("--seed", type=int, default=0, help="DistributedSampler seed")
    args = p.parse_args(argv)
    for name in ["world_size", "num_samples", "batch_size"]:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_epochs < 2:
        p.error(f"--num-epochs must be >= 2 to compare epochs, got {args.num_epochs}")
    orders = epoch_orders(args.mode, args.world_size, args.num_samples, args.num_epochs,
                          args.batch_size, args.seed)
    problems = check_orders(orders, args.world_size, args.num_epochs, args.num_samples)
    for line in problems:
        print(line, flush=True)
    if problems:
        sys.exit(1)
    print(f"ok: {args.num_epochs} epochs, every epoch in a new order on all "
          f"{args.world_size} ranks", flush=True)


if __name__ == "__main__":
    main()
