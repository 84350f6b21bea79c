"""Data for the labs: synthetic sequences whose loss visibly falls, or a real token file,
served to each rank by a DistributedSampler that can resume mid-epoch."""

import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from labkit.errors import fail_config

class SyntheticSequences(Dataset):
    """Arithmetic token sequences: start + stride * t (mod vocab). Sample i is a pure function of
    (seed, i), so every rank and every rerun sees the same data. After two tokens the rest is
    predictable, so the loss falls well below ln(vocab)."""

    def __init__(self, num_samples, seq_len, vocab_size, seed):
        self.num_samples, self.seq_len, self.vocab_size, self.seed = (
            num_samples, seq_len, vocab_size, seed)

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(self.seed * 7919 + index)
        start, stride = torch.randint(0, self.vocab_size, (2,), generator=generator).tolist()
        tokens = (start + (1 + stride % 7) * torch.arange(self.seq_len + 1)) % self.vocab_size
        return tokens[:-1], tokens[1:]


class TokenWindows(Dataset):
    """A real corpus: non-overlapping windows of seq_len + 1 tokens from one file, memory-mapped
    (torch.from_file, private mapping: pages load on first touch, the file is never written).
    *.bin: raw token ids, uint16 or uint32 (the train.bin of nanoGPT-style preparation scripts);
    any other file: its bytes, a vocabulary of 256. Window i starts at token i * seq_len; the
    sampler shuffles the windows per epoch, so the order changes and resume stays exact."""

    def __init__(self, path, seq_len, dtype_name):
        dtype = token_dtype(path, dtype_name)
        count = os.path.getsize(path) // dtype.itemsize
        self.tokens = torch.from_file(str(path), shared=False, size=count, dtype=dtype)
        self.seq_len = seq_len

    def __len__(self):
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index):
        start = index * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1].to(torch.int64)
        return window[:-1], window[1:]


def token_dtype(path, dtype_name):
    if not str(path).endswith(".bin"):
        return torch.uint8
    return {"uint16": torch.uint16, "uint32": torch.uint32}[dtype_name]


def build_dataset(cfg):
    if cfg.data:
        return TokenWindows(cfg.data, cfg.seq_len, cfg.data_dtype)
    return SyntheticSequences(cfg.num_samples, cfg.seq_len, cfg.vocab_size, cfg.seed)


def dataset_length(cfg):
    if not cfg.data:
        return cfg.num_samples
    return max(0, (os.path.getsize(cfg.data) // token_dtype(cfg.data, cfg.data_dtype).itemsize
                   - 1) // cfg.seq_len)


def validate_data_file(cfg):
    """Before any process group: the file exists, has whole tokens, and every id fits the
    vocabulary (on a GPU an id out of range is a device-side assert, far from its cause)."""
    path = Path(cfg.data)
    if not path.is_file():
        fail_config("--data", f"no such file: {path}")
    dtype = token_dtype(path, cfg.data_dtype)
    if path.stat().st_size % dtype.itemsize:
        fail_config("--data", f"{path.stat().st_size} bytes is not a whole number of "
                    f"{cfg.data_dtype} tokens; is --data-dtype right?")
    tokens = torch.from_file(str(path), shared=False, size=path.stat().st_size // dtype.itemsize,
                             dtype=dtype)
    chunk = 1 << 24  # one pass in 16M-token pieces: a 10B-token file takes a minute
    largest = max((int(tokens[i:i + chunk].to(torch.int64).max()) for i in
                   range(0, len(tokens), chunk)), default=0)
    if largest >= cfg.vocab_size:
        fail_config("--data", f"holds token id {largest}, but --vocab-size is {cfg.vocab_size}")


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can start mid-epoch, so a resumed run sees exactly the batches
    the interrupted one would have seen next."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start_index = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start_index:])

    def __len__(self):
        return self.num_samples - self.start_index


def make_loader(cfg, dataset, sampler, micro_batch, pin_memory):
    """The DataLoader of one rank. Every iter(loader) draws a seed for its workers from
    loader.generator; left out, it draws from the global RNG, and a resumed run (fewer iter()
    calls) would continue on another RNG stream than an uninterrupted one. The epoch loop
    seeds it per epoch, so both draw the same. pin_memory (on CUDA): a non_blocking copy from
    pageable memory is synchronous anyway; from pinned memory it overlaps with compute."""
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True,
                      num_workers=cfg.num_workers, generator=torch.Generator(),
                      pin_memory=pin_memory, timeout=cfg.timeout_s if cfg.num_workers else 0)


def micro_batches(cfg, rank, world_size, start_step, pin_memory=False):
    """This rank's micro-batches, forever, from optimizer step `start_step` on. lab01 writes
    the same loop out, because it teaches it; rank and world_size are the data-parallel ones."""
    dataset = build_dataset(cfg)
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=cfg.seed, drop_last=True)
    loader = make_loader(cfg, dataset, sampler, cfg.batch_size // (world_size * cfg.grad_accum),
                         pin_memory)
    per_epoch = sampler.num_samples // loader.batch_size
    epoch, skip = divmod(start_step * cfg.grad_accum, per_epoch)
    while True:
        sampler.set_epoch(epoch)
        sampler.start_index = skip * loader.batch_size
        loader.generator.manual_seed(cfg.seed * 1_000_003 + epoch)
        yield from loader
        epoch, skip = epoch + 1, 0
