"""Drill: DataLoader workers whose memory grows as they read a Python-object dataset (runbook
dataloader-memory-growth). Linux only: it reads /proc/self/smaps_rollup.

Workers are forked from the main process and share its pages copy-on-write. Reading a Python
object writes to it (its reference count), so every page of the parent's list of strings that
a worker touches gets copied into that worker: after one shuffled epoch each worker holds its
own copy, and a node holds about (num_workers x ranks per node) copies. The same strings packed
into one uint8 tensor plus an offsets tensor are read without writing, and stay shared.

    python runbooks/drills/dataloader_worker_memory.py                  # both kinds, 2 workers
    python runbooks/drills/dataloader_worker_memory.py --num-workers 1 2 4
Output, one line per kind and worker count (private = pages this worker no longer shares;
measured here with --num-samples 400000):
    kind list   | workers 2 | dataset 37.8 MiB | private per worker 35.1 MiB | all workers 70.3 MiB
    kind tensor | workers 2 | dataset 19.0 MiB | private per worker 1.5 MiB | all workers 2.9 MiB
"""

import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info


def private_bytes():
    """Bytes of this process's pages that no other process shares (USS)."""
    total = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def make_strings(num_samples):
    return [f"shard-{i // 1000:05d}/sample-{i:09d}.jpg label={i % 1000}" for i in range(num_samples)]


class ListDataset(Dataset):
    """The common pattern: a Python list of per-sample records (paths, captions, dicts)."""

    def __init__(self, num_samples):
        self.records = make_strings(num_samples)

    def __len__(self):
        return len(self.records)

    def __getitem__(self, index):
        return len(self.records[index])  # reading the str bumps its refcount: a page write


class TensorDataset(Dataset):
    """The fix: the same records as one flat byte tensor plus offsets. Two objects in total, so
    reading a record writes nothing the workers share (numpy or pyarrow arrays work the same)."""

    def __init__(self, num_samples):
        encoded = [s.encode() for s in make_strings(num_samples)]
        lengths = torch.tensor([len(b) for b in encoded], dtype=torch.int64)
        self.offsets = torch.zeros(len(encoded) + 1, dtype=torch.int64)
        self.offsets[1:] = torch.cumsum(lengths, 0)
        self.data = torch.frombuffer(bytearray(b"".join(encoded)), dtype=torch.uint8)
        del encoded

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, index):
        start, end = self.offsets[index].item(), self.offsets[index + 1].item()
        return len(bytes(self.data[start:end].numpy()).decode())


def collate_with_memory(lengths):
    """Runs in the worker: the batch plus this worker's id and private memory right now."""
    return torch.tensor(lengths), get_worker_info().id, private_bytes()


def dataset_bytes(dataset):
    """What the records occupy in the parent process, counted object by object."""
    if isinstance(dataset, ListDataset):
        return sys.getsizeof(dataset.records) + sum(map(sys.getsizeof, dataset.records))
    return dataset.data.nbytes + dataset.offsets.nbytes


def measure(kind, num_workers, num_samples, batch_size):
    dataset = (ListDataset if kind == "list" else TensorDataset)(num_samples)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers,
                        collate_fn=collate_with_memory, timeout=300,
                        generator=torch.Generator().manual_seed(0))
    first, last, total = {}, {}, 0
    for lengths, worker_id, private in loader:  # one shuffled epoch, as training reads it
        first.setdefault(worker_id, private)
        last[worker_id] = private
        total += int(lengths.sum())
    growth = [last[w] - first[w] for w in sorted(last)]
    size = dataset_bytes(dataset)
    return {"kind": kind, "num_workers": num_workers, "dataset_bytes": size,
            "private_growth_per_worker": growth, "private_final_per_worker":
            [last[w] for w in sorted(last)], "checksum": total}


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None):
    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", choices=["list", "tensor"], default=["list", "tensor"],
                   help="dataset storage: list (Python str objects) or tensor (bytes + offsets)")
    p.add_argument("--num-workers", type=int, nargs="+", default=[2],
                   help="worker counts to measure")
    p.add_argument("--num-samples", type=int, default=200_000, help="records in the dataset")
    p.add_argument("--batch-size", type=int, default=1000, help="records per batch")
    p.add_argument("--json-out", default="", help="write the measurements here")
    args = p.parse_args(argv)
    if not os.path.exists("/proc/self/smaps_rollup"):
        p.error("needs Linux /proc/self/smaps_rollup (kernel >= 4.14)")
    if min(args.num_workers) < 1:
        p.error(f"--num-workers must be >= 1 (the growth happens in workers), got {args.num_workers}")
    if args.num_samples < 1 or args.batch_size < 1:
        p.error("--num-samples and --batch-size must be >= 1")
    results = []
    for kind in args.kinds:
        for num_workers in args.num_workers:
            r = measure(kind, num_workers, args.num_samples, args.batch_size)
            results.append(r)
            per_worker = max(r["private_growth_per_worker"])
            print(f"kind {kind:6s} | workers {num_workers} | dataset "
                  f"{r['dataset_bytes'] / 2**20:.1f} MiB | private per worker "
                  f"{per_worker / 2**20:.1f} MiB | all workers "
                  f"{sum(r['private_growth_per_worker']) / 2**20:.1f} MiB", flush=True)
    if len({r["checksum"] for r in results}) != 1:
        sys.exit("bug: the two kinds returned different data")
    if args.json_out:
        with open(args.json_out + ".tmp", "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
        os.replace(args.json_out + ".tmp", args.json_out)


if __name__ == "__main__":
    main()
