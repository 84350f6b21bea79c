"""Lab 02: FSDP2 (fully_shard), sharding you can see and memory that matches the math.

What it teaches: each rank keeps only a shard (dim 0, a DTensor with Shard(0)) of every
parameter, gradient and optimizer state. Before a block computes, FSDP all-gathers its full
parameters; after backward it reduce-scatters the gradients, so each rank gets the mean gradient
of its own shard. The model is built on the meta device and sharded before any memory exists,
so no rank ever holds the whole model. `--check-parity` retrains the same global batches in one
process and compares every parameter (fp32 on CPU: max |diff| must be <= 1e-5).

Launch (the same file everywhere; the backend follows the hardware):
    python labs/lab02_fsdp.py                                       # 1 process, no torchrun
    torchrun --nproc-per-node 4 labs/lab02_fsdp.py --check-parity   # CPU + gloo, or GPUs + nccl
    torchrun --nproc-per-node 4 labs/lab02_fsdp.py --hsdp 2         # 2 replicas x 2 shards
    torchrun --nproc-per-node 2 labs/lab02_fsdp.py --strategy ddp   # the baseline it beats
    # two nodes (run on each; same --rdzv-id everywhere, node 0's address as the endpoint;
    # --checkpoint-dir must be on a filesystem both nodes share):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29400 --rdzv-id $JOB_ID labs/lab02_fsdp.py --hsdp 2

Minimum world size: 1. Expected last line of the --check-parity run at 4 ranks (numbers vary
slightly with hardware; the default global batch is 8 sequences per rank, so the loss depends
on the world size unless --batch-size is given):
    done | lab02_fsdp | gloo x4 | 40 steps | loss 0.24... | parity 2.7e-07 | ...
Needs torch >= 2.6 (fully_shard and its policies became public in torch.distributed.fsdp then).
Lesson: lessons/02_fsdp.py. Runbooks: runbooks/ (OOM, NCCL hangs). Memory model:
labs/memory_estimator.py (what each rank should hold, and what that figure leaves out).

Use it in your project:
  - Replace: `build_model()` (run on the meta device by `build_fsdp_model()`); the loop over
    `model.layers` in `apply_fsdp()` (one unit per block of yours); `init_sharded_weights()`,
    which fills each shard from `initial_value()` (pretrained weights: dcp.load into the
    sharded model, as `load_checkpoint()` does); `SyntheticSequences`; `loss_fn()`.
  - Keep: the order in `build_fsdp_model()`: meta device, fully_shard on blocks then the root,
    to_empty, fill (runbooks/oom-distributed-causes.md); `build_optimizer()` after it;
    `gradient_sync()`; DCP `save_checkpoint()` / `load_checkpoint()` (tmp dir, then rename;
    any world size); `--mixed-precision bf16`: bf16 matmuls, fp32 shards and grad reduction.
  - Pitfalls: fully_shard replaces every parameter: an optimizer built before it trains
    nothing, silently. Sharding only the root gathers the whole model at once; one unit per
    Linear means many small collectives. dcp.save and `full_state_dict()` are collectives:
    never under `if rank == 0` (runbooks/collective-timeout.md). Out of memory:
    `--activation-checkpointing`, `--cpu-offload` (runbooks/oom-mitigations.md).
"""

import argparse
import contextlib
import datetime
import functools
import gc
import json
import math
import os
import resource
import shutil
import signal
import socket
import sys
import time
import traceback
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

LAB_NAME = "lab02_fsdp"


# --8<-- [start:cli]
class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; a lab prints one line and exits 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail_config(flag, message):
    """Reject a bad value before any process group exists: one line, exit status 2."""
    print(f"{Path(sys.argv[0]).name}: error: {flag}: {message}", file=sys.stderr)
    sys.exit(2)


def add_common_args(parser):
    arg = parser.add_argument
    arg("--steps", type=int, default=40, help="optimizer steps in total")
    arg("--micro-batch-size", type=int, default=8,
        help="sequences per data-parallel rank per micro-step; sets the default --batch-size")
    arg("--batch-size", type=int, default=0,
        help="global batch, in sequences per optimizer step (0: --micro-batch-size x "
             "data-parallel ranks x --grad-accum, so the defaults work at any world size)")
    arg("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    arg("--seq-len", type=int, default=32, help="tokens per sequence")
    arg("--dim", type=int, default=64, help="model width")
    arg("--num-layers", type=int, default=2, help="transformer blocks")
    arg("--num-heads", type=int, default=4, help="attention heads")
    arg("--vocab-size", type=int, default=64, help="vocabulary size")
    arg("--num-samples", type=int, default=512, help="synthetic dataset size (sequences)")
    arg("--lr", type=float, default=3e-3, help="AdamW learning rate (after the warmup)")
    arg("--warmup-steps", type=int, default=5,
        help="linear learning-rate warmup from 0 over this many steps (0: none); see "
             "learning_rate()")
    arg("--clip", type=float, default=1.0, help="max gradient norm (0 disables clipping)")
    arg("--seed", type=int, default=0, help="seed for init, data order and RNG")
    arg("--device", choices=["auto", "cpu", "cuda"], default="auto",
        help="auto: cuda + nccl when every local rank has a GPU, else cpu + gloo")
    arg("--amp", choices=["auto", "bf16", "off"], default="auto",
        help="autocast dtype for the forward pass; auto = bf16 on cuda, off (fp32) on cpu")
    arg("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    arg("--timeout-s", type=float, default=120.0,
        help="seconds any collective or worker may block before it becomes an error")
    arg("--log-every", type=int, default=10, help="steps between log lines")
    arg("--checkpoint-dir", default="", help="where checkpoints go; resumes from the newest")
    arg("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: end only)")
    arg("--resume", action="store_true", help="require a checkpoint in --checkpoint-dir")
    arg("--stop-at-step", type=int, default=0,
        help="checkpoint and stop after this step, as if interrupted (0: run to --steps)")
    arg("--metrics-out", default="", help="write the final metrics JSON here (rank 0)")
    arg("--check-parity", action="store_true",
        help="retrain in one process on the same global batches and compare parameters")
    arg("--parity-tol", type=float, default=1e-5, help="max |param diff| allowed by --check-parity")
    arg("--fail-at-step", type=int, default=0,
        help="fault drill: --fail-rank dies abruptly at this step, first attempt only (0: never)")
    arg("--fail-rank", type=int, default=0, help="fault drill: which rank dies")
    arg("--crash-in-checkpoint", type=int, default=0,
        help="fault drill: die while writing the checkpoint of this step, before it is complete")
    arg("--stall-at-step", type=int, default=0,
        help="fault drill: --fail-rank stops responding at this step, first attempt only; the "
             "others must fail within --timeout-s (0: never)")


def validate_common(cfg, world_size, dp_size):
    """Checks every lab shares. dp_size: the ranks that split the batch (world size over the
    model-parallel degrees); it fills in the default --batch-size."""
    positive = ["steps", "micro_batch_size", "grad_accum", "seq_len", "dim", "num_layers",
                "num_heads", "vocab_size", "num_samples", "lr", "timeout_s", "log_every"]
    for name in positive:
        if getattr(cfg, name) <= 0:
            fail_config(f"--{name.replace('_', '-')}", f"must be > 0, got {getattr(cfg, name)}")
    for name in ["batch_size", "clip", "num_workers", "checkpoint_every", "stop_at_step",
                 "parity_tol", "fail_at_step", "fail_rank", "crash_in_checkpoint",
                 "stall_at_step", "warmup_steps"]:
        if getattr(cfg, name) < 0:
            fail_config(f"--{name.replace('_', '-')}", f"must be >= 0, got {getattr(cfg, name)}")
    if cfg.dim % cfg.num_heads or (cfg.dim // cfg.num_heads) % 2:
        fail_config("--dim", f"{cfg.dim} must split into --num-heads {cfg.num_heads} even-sized heads")
    per_micro_step = dp_size * cfg.grad_accum
    trained_with = checkpointed_batch_size(cfg.checkpoint_dir)
    if trained_with and cfg.batch_size and cfg.batch_size != trained_with:
        fail_config("--batch-size", f"{cfg.batch_size}, but the checkpoints in "
                    f"{cfg.checkpoint_dir} were trained with {trained_with}: leave it out to "
                    f"continue with {trained_with}, or start a new --checkpoint-dir")
    # A resume keeps the global batch it was trained with, whatever the world size is now.
    cfg.batch_size = cfg.batch_size or trained_with or cfg.micro_batch_size * per_micro_step
    if cfg.batch_size % per_micro_step:
        fail_config("--batch-size", f"{cfg.batch_size} must be divisible by data-parallel ranks "
                    f"x --grad-accum = {dp_size} x {cfg.grad_accum} (or leave it out: 0 means "
                    f"--micro-batch-size x {per_micro_step})")
    if cfg.num_samples < cfg.batch_size:
        fail_config("--num-samples", f"{cfg.num_samples} is smaller than one global batch")
    if cfg.fail_rank >= world_size:
        fail_config("--fail-rank", f"{cfg.fail_rank} is not a rank of a world of {world_size}")
    if cfg.stop_at_step > cfg.steps:
        fail_config("--stop-at-step", f"{cfg.stop_at_step} is beyond --steps {cfg.steps}")
    if (cfg.resume or cfg.checkpoint_every or cfg.stop_at_step or cfg.crash_in_checkpoint) \
            and not cfg.checkpoint_dir:
        fail_config("--checkpoint-dir", "required by --resume, --checkpoint-every, "
                    "--stop-at-step and --crash-in-checkpoint")
    if cfg.resume and not latest_checkpoint(cfg.checkpoint_dir):
        fail_config("--resume", f"no complete checkpoint in {cfg.checkpoint_dir}")
    if cfg.device == "cuda" and torch.cuda.device_count() < local_world_size():
        fail_config("--device", f"cuda needs one GPU per local rank: {local_world_size()} ranks, "
                    f"{torch.cuda.device_count()} GPUs visible; use --device cpu")
    if cfg.check_parity and resolve_amp(cfg, pick_device_type(cfg)) != "off":
        fail_config("--check-parity", "needs fp32 (--amp off): bf16 rounding is far above 1e-5")


def checkpointed_batch_size(directory):
    """The global batch of the run whose checkpoints are in `directory`, or None."""
    record = Path(directory) / "run.json" if directory else None
    if record and record.exists() and latest_checkpoint(directory):
        return json.loads(record.read_text())["batch_size"]
    return None


def record_batch_size(cfg):
    """Rank 0, with every checkpoint: what a resume at another world size must keep."""
    write_json_atomic(Path(cfg.checkpoint_dir) / "run.json", {"batch_size": cfg.batch_size})
# --8<-- [end:cli]


def parse_config(argv=None):
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    arg = parser.add_argument
    arg("--strategy", choices=["fsdp", "ddp", "zero1"], default="fsdp",
        help="fsdp: fully_shard (ZeRO-3); ddp: full replica; zero1: DDP + ZeroRedundancyOptimizer")
    arg("--reshard-after-forward", choices=["true", "false"], default="true",
        help="false keeps each block's gathered params from forward to backward (ZeRO-2-like)")
    arg("--mixed-precision", choices=["fp32", "bf16"], default="fp32",
        help="bf16: FSDP gathers and computes in bf16, reduces grads in fp32")
    arg("--activation-checkpointing", action="store_true",
        help="recompute each block's activations in backward instead of storing them")
    arg("--cpu-offload", action="store_true",
        help="keep sharded params, grads and optimizer step on the CPU (CPUOffloadPolicy)")
    arg("--hsdp", type=int, default=0, metavar="R",
        help="HSDP: replicate across R groups, shard within each (0: plain FSDP)")
    arg("--compile", action="store_true", help="torch.compile each block before sharding")
    arg("--compile-backend", default="inductor",
        help="torch.compile backend (aot_eager skips code generation; useful to bisect)")
    arg("--export", default="",
        help="write one consolidated state dict file here at the end (loads in one process)")
    cfg = parser.parse_args(argv)
    world_size = world_size_from_env()
    validate_common(cfg, world_size, dp_size=world_size)  # HSDP too: every rank has its own data
    validate_fsdp(cfg, world_size)
    return cfg


def validate_fsdp(cfg, world_size):
    if cfg.strategy != "fsdp":
        for flag, used in [("--hsdp", cfg.hsdp), ("--cpu-offload", cfg.cpu_offload),
                           ("--mixed-precision", cfg.mixed_precision != "fp32"),
                           ("--reshard-after-forward", cfg.reshard_after_forward != "true")]:
            if used:
                fail_config(flag, f"applies to --strategy fsdp only, not {cfg.strategy}")
    if cfg.hsdp < 0 or (cfg.hsdp and world_size % cfg.hsdp):
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        fail_config("--hsdp", f"{cfg.hsdp} must divide the world size {world_size}; "
                    f"allowed: 0 (off) or {', '.join(map(str, divisors))}")
    if cfg.mixed_precision == "bf16" and cfg.check_parity:
        fail_config("--check-parity", "needs --mixed-precision fp32: bf16 rounding is far above 1e-5")
    if cfg.strategy == "zero1" and cfg.checkpoint_dir:
        fail_config("--checkpoint-dir", "not supported with --strategy zero1 in this lab "
                    "(ZeroRedundancyOptimizer state must be consolidated to one rank first)")


# --8<-- [start:setup]
def world_size_from_env():
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size():
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def pick_device_type(cfg):
    if cfg.device != "auto":
        return cfg.device
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size()
    return "cuda" if enough_gpus else "cpu"


def resolve_amp(cfg, device_type):
    if cfg.amp == "auto":
        return "bf16" if device_type == "cuda" else "off"
    return cfg.amp


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(cfg):
    """Start the process group; without torchrun, become a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device_type = pick_device_type(cfg)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    world_size = int(os.environ["WORLD_SIZE"])
    store = attempt_store(rank, world_size, timeout)
    if device_type == "cuda":
        # set_device first: device_id= binds the communicator to this GPU anyway, but every
        # tensor made on plain "cuda" (ours, or a library's) would land on cuda:0.
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    return rank, world_size, device


def attempt_store(rank, world_size, timeout):
    """The rendezvous store that env:// would give us, with keys namespaced by restart attempt.

    torchrun (c10d rendezvous, torch <= 2.13 at least) hands every restart attempt the same
    TCPStore, so a restarted worker can read the dead attempt's gloo/NCCL addresses and fail
    ("Gloo connectFullMesh failed ... Connection refused") or hang. See runbooks/restart-hang.md.
    """
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=hosts_store, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt{attempt}/", store)


def teardown_distributed():
    """Destroy the process group after everything that holds it is gone.

    A DDP model's C++ Reducer owns a reference to the group. Freed after
    destroy_process_group(), it destroys the gloo group while holding the GIL, and the gloo
    destructor joins a worker thread that needs the GIL: the rank hangs after its last line,
    or aborts at exit ("terminate called without an active exception"). Models die with
    run(); gc.collect() frees the ones kept alive by reference cycles. runbooks/exit-hang.md
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
# --8<-- [end:setup]


# --8<-- [start:mesh]
def init_mesh(device_type, mesh_shape, mesh_dim_names, timeout):
    """init_device_mesh, with init_process_group's timeout on every axis.

    In torch 2.13 init_device_mesh creates each axis smaller than the world with
    new_group(timeout=None), and that means the backend default (30 min on gloo, 10 on NCCL),
    not the timeout of the default group: a rank stuck in an FSDP, TP or pipeline collective
    would hold the job for that long. So each axis's groups are built here with the timeout,
    then wrapped in a DeviceMesh. Rank r sits at the position of r in
    arange(world).view(mesh_shape), as init_device_mesh would place it."""
    ranks = torch.arange(math.prod(mesh_shape)).view(mesh_shape)
    groups = []
    for dim, name in enumerate(mesh_dim_names):
        # One row per group along this axis: the ranks that differ only in coordinate `dim`.
        rows = ranks.movedim(dim, -1).reshape(-1, mesh_shape[dim]).tolist()
        group, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout,
                                                     group_desc=f"mesh_{name}")
        groups.append(group)
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=mesh_dim_names)
# --8<-- [end:mesh]


# --8<-- [start:model]
def initial_value(name, shape, seed):
    """Initial value of one parameter, keyed by its name: the same on every rank, whatever
    the parallel layout, so sharded and pipelined labs can build it piece by piece."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = 0.02 if "embeddings" in name else 1.0 / math.sqrt(shape[-1])
    return torch.randn(shape, generator=generator) * std


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq_len, head_dim, device):
    """Rotary-embedding cos/sin, computed per call: no buffers, so DDP has none to broadcast."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)  # fp32 tables must not upcast bf16 q/k


class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.head_dim = dim // num_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        bsz, seq_len, _ = x.shape
        # -1 heads: tensor parallel shards wq/wk/wv by heads, and this still works unchanged.
        q, k, v = (w(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        cos, sin = rope_tables(seq_len, self.head_dim, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, num_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    """Llama-style decoder. Layers live in a ModuleDict keyed by index, so a pipeline stage can
    delete the others (and set tok_embeddings / norm / output to None) without renaming."""

    def __init__(self, vocab_size, dim, num_layers, num_heads):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, num_heads) for i in range(num_layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed):
        for name, param in self.named_parameters():
            param.copy_(initial_value(name, param.shape, seed))


def build_model(cfg):
    return TinyLlama(cfg.vocab_size, cfg.dim, cfg.num_layers, cfg.num_heads)
# --8<-- [end:model]


# --8<-- [start:data]
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


def micro_batches(cfg, rank, world_size, start_step):
    """Yield this rank's micro-batches forever, starting at optimizer step `start_step`."""
    dataset = SyntheticSequences(cfg.num_samples, cfg.seq_len, cfg.vocab_size, cfg.seed)
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=cfg.seed, drop_last=True)
    micro_batch = cfg.batch_size // (world_size * cfg.grad_accum)
    # Every iter(loader) draws a seed for its workers from `generator`; left out, it draws
    # from the global RNG, and a resumed run (fewer iter() calls) would continue on another
    # RNG stream than an uninterrupted one. Seeded per epoch below, so both draw the same.
    seeds = torch.Generator()
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True,
                        num_workers=cfg.num_workers, generator=seeds,
                        timeout=cfg.timeout_s if cfg.num_workers else 0)
    per_epoch = sampler.num_samples // micro_batch
    epoch, skip = divmod(start_step * cfg.grad_accum, per_epoch)
    while True:
        sampler.set_epoch(epoch)  # without this every epoch repeats the same order
        sampler.start_index = skip * micro_batch
        seeds.manual_seed(cfg.seed * 1_000_003 + epoch)
        yield from loader
        epoch, skip = epoch + 1, 0
# --8<-- [end:data]


# --8<-- [start:metrics]
def peak_memory_bytes(device):
    """CUDA: peak bytes allocated by tensors. CPU: peak resident set size of the process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def seconds_since(t0, device):
    """Wall time since t0 once the device has finished its queued work: CUDA kernels run
    asynchronously, so without the synchronize a step time measures the CPU's dispatch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def log_line(step, loss, step_s, tokens_per_s, data_share, mem_bytes):
    return (f"step {step:4d} | loss {loss:.4f} | {step_s * 1e3:.1f} ms | "
            f"{tokens_per_s:.0f} tok/s | data {data_share:.0%} | mem {mem_bytes / 2**30:.2f} GiB")


def write_json_atomic(path, payload):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


def summary_line(metrics):
    parity = metrics["parity_max_abs_diff"]
    return (f"done | {metrics['lab']} | {metrics['backend']} x{metrics['world_size']} | "
            f"{metrics['steps']} steps | loss {metrics['final_loss']:.4f} | parity "
            f"{'n/a' if parity is None else f'{parity:.1e}'} | "
            f"{metrics['tokens_per_s']:.0f} tok/s | {metrics['wall_time_s']:.1f} s")
# --8<-- [end:metrics]


# --8<-- [start:faults]
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "stopped on request, checkpoint written, rerun me"


def maybe_inject_failure(cfg, step, rank):
    """--fail-at-step K --fail-rank R: rank R dies abruptly (no cleanup) at step K. Only on the
    first attempt, so the run that torchrun restarts can get past it."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and step == cfg.fail_at_step and rank == cfg.fail_rank:
        print(f"injected failure: rank {rank} exits at step {step}", file=sys.stderr, flush=True)
        os._exit(13)


def maybe_crash_mid_checkpoint(cfg, step):
    """--crash-in-checkpoint K: die after part of step K's checkpoint is on disk but before it
    is complete (first attempt only), as an OOM kill or a power cut would."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and step == cfg.crash_in_checkpoint:
        print(f"injected crash while writing the checkpoint of step {step}", file=sys.stderr,
              flush=True)
        os._exit(14)


def maybe_stall(cfg, step, rank, preemption):
    """--stall-at-step K --fail-rank R: rank R stops responding at step K (first attempt only)
    but stays alive, as a rank stuck in I/O or behind a dead link would. Its peers block in
    their next collective with it, on whichever group that is, and must fail after --timeout-s.
    A SIGTERM (torchrun stopping the job) ends the stall, so the drill never outlives the job."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and step == cfg.stall_at_step and rank == cfg.fail_rank:
        print(f"injected stall: rank {rank} stops responding at step {step}", file=sys.stderr,
              flush=True)
        deadline = time.monotonic() + 10 * cfg.timeout_s
        while time.monotonic() < deadline and not preemption.requested:
            time.sleep(0.1)


class PreemptionWatch:
    """SIGTERM (a scheduler preempting the job) only raises a flag; the loop finishes the
    step, and all ranks agree with one all-reduce so they checkpoint and stop together."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.requested = True

    def agreed(self, device):
        flag = torch.tensor([float(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
# --8<-- [end:faults]


# --8<-- [start:schedule]
def learning_rate(cfg, step):
    """Linear warmup from 0 over --warmup-steps (the shape of Hugging Face's
    get_linear_schedule_with_warmup), then constant. A pure function of the step, so a resumed
    run needs no scheduler state.

    Why it matters for parity: Adam's first update is lr * g / (|g| + eps), which is close to
    lr * sign(g) for every entry with |g| well above eps = 1e-8, however small g is next to the
    rest of the gradient. Such an entry can be rounding noise, and any change in summation order
    (a bucketed all-reduce over 3 ranks, TP's split matmuls) can flip its sign, moving that weight
    about 2 * lr away from the single-process run. With lr 0 at step 1, the first real update
    divides each entry by the RMS of two steps' gradients, and one noisy value no longer
    decides. Early-step Adam variance is also why transformer recipes warm up (arXiv:1908.03265).
    """
    if cfg.warmup_steps == 0:
        return cfg.lr
    return cfg.lr * min(1.0, (step - 1) / cfg.warmup_steps)


def set_learning_rate(optimizers, cfg, step):
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
# --8<-- [end:schedule]


# The point of the lab: shard with fully_shard, measure what each rank holds, checkpoint with DCP.
def build_mesh(cfg, device, world_size):
    """1D ("dp",) for FSDP; 2D ("dp_replicate", "dp_shard") for HSDP, where the shard axis is
    the inner (fast, intra-node) one: all-gather and reduce-scatter stay inside a group of
    world_size / R ranks, and only an all-reduce of the grad shards crosses groups."""
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if cfg.hsdp:
        return init_mesh(device.type, (cfg.hsdp, world_size // cfg.hsdp),
                         ("dp_replicate", "dp_shard"), timeout)
    return init_mesh(device.type, (world_size,), ("dp",), timeout)


def apply_activation_checkpointing(model):
    # torch.utils.checkpoint, non-reentrant: store only each block's input, recompute the rest
    # in backward. Wrapping forward in place (not in a wrapper module) keeps parameter names,
    # so init, checkpoints and the single-process reference all agree.
    for block in model.layers.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def apply_compile(model, backend):
    # Per block, in place: the blocks are identical, so one compiled graph is reused, and the
    # FSDP hooks added later stay outside it (they are dynamo-disabled, graph breaks are fine).
    for block in model.layers.values():
        block.compile(backend=backend)


def apply_fsdp(model, mesh, cfg, device):
    """fully_shard bottom-up: each block is one communication unit (one all-gather in forward,
    one all-gather + one reduce-scatter in backward); the root call groups what is left
    (embeddings, final norm, output) and owns the lazy init of the whole tree."""
    kwargs = {"mesh": mesh}
    if cfg.mixed_precision == "bf16":
        # Params are all-gathered and used in bf16; grads are reduced in fp32 so the average
        # over ranks does not lose bits. The sharded fp32 params stay the optimizer's master copy.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    if cfg.cpu_offload:
        # Shards live in host memory; each all-gather copies them to the device first, and the
        # optimizer step runs on the CPU. Pinned memory needs a GPU, so only pin on cuda.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    # true: free the gathered params after forward, gather again in backward (ZeRO-3).
    # false: keep them until backward ends; one all-gather less, full-size params at the peak.
    reshard = cfg.reshard_after_forward == "true"
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root keeps its params gathered after forward by default: backward starts with them.
    fully_shard(model, **kwargs)
    return model


def shard_of(full, dtensor):
    """The slice of `full` that this rank holds in `dtensor`: torch.chunk along each Shard
    dim, as DTensor lays it out (trailing ranks get fewer, or zero, rows)."""
    local, coordinate = full, dtensor.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(dtensor.placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(local, dtensor.device_mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            local = chunks[index] if index < len(chunks) else local.narrow(placement.dim, 0, 0)
    return local


@torch.no_grad()
def init_sharded_weights(model, seed):
    """Fill each rank's shards with the values a single process would have. Trade-off: every
    rank computes one full parameter at a time (extra memory: the largest parameter; CPU work
    repeated on every rank; no communication at all). distribute_tensor(full, mesh, placements)
    would instead scatter rank 0's copy (one compute, one collective per parameter). A real
    large model skips both: it loads its shards from a DCP checkpoint."""
    for name, param in model.named_parameters():
        local = shard_of(initial_value(name, param.shape, seed), param)
        assert param.to_local().shape == local.shape, (name, param.to_local().shape, local.shape)
        param.to_local().copy_(local)


def build_fsdp_model(cfg, mesh, device):
    with torch.device("meta"):  # shapes only: no rank allocates the full model
        model = build_model(cfg)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.compile:
        apply_compile(model, cfg.compile_backend)
    apply_fsdp(model, mesh, cfg, device)
    # Allocate only the local shards, then fill them.
    model.to_empty(device="cpu" if cfg.cpu_offload else device)
    init_sharded_weights(model, cfg.seed)
    return model


def build_replicated_model(cfg, device):
    """The baselines: every rank holds the whole model (DDP all-reduces gradients)."""
    model = build_model(cfg).to(device)
    model.init_weights(cfg.seed)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.compile:
        apply_compile(model, cfg.compile_backend)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def build_optimizer(cfg, model):
    if cfg.strategy == "zero1":
        # ZeRO-1: each rank keeps the AdamW state of its share of the parameters (whole
        # tensors, assigned greedily by size), steps them, then broadcasts the new values.
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                       lr=cfg.lr)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr)


def inspect_fsdp(model, mesh, cfg):
    """What each rank holds after fully_shard: every parameter a DTensor on the mesh, Shard(0)
    on the shard axis (plus Replicate() on the replicate axis for HSDP), local rows as chunked
    by torch.chunk. Returns {name: [placements, global shape, local shapes per rank]}."""
    expected = (Replicate(), Shard(0)) if cfg.hsdp else (Shard(0),)
    shard_size, shard_rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    layout = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh == mesh, name
        assert tuple(param.placements) == expected, (name, param.placements)
        rows = math.ceil(param.shape[0] / shard_size)
        local_rows = max(0, min(rows, param.shape[0] - rows * shard_rank))
        assert param.to_local().shape == (local_rows, *param.shape[1:]), name
        layout[name] = [str(tuple(param.placements)), list(param.shape),
                        list(param.to_local().shape)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, layout)
    return {name: [*gathered[0][name][:2], [g[name][2] for g in gathered]] for name in layout}


def held_bytes(tensors):
    """Bytes of the storage behind these tensors, each storage counted once: DTensors count
    their local shard, FSDP's padded shard storage counts with its padding, and gradients that
    are views into one reduce-scatter output count that buffer once."""
    storages = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def measure_state_bytes(model, optimizer):
    """This rank's persistent training state, measured from the tensors it holds."""
    local_optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps one
    states = [v for state in local_optimizer.state.values() for v in state.values()
              if torch.is_tensor(v)]
    return {"params": held_bytes(p for p in model.parameters()),
            "grads": held_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": held_bytes(states)}


def unsharded_param_bytes(model):
    """Bytes of parameters registered in full form right now. Between forward and backward
    this is what reshard_after_forward decides: the root only (true) or every block (false)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if not isinstance(p, DTensor))


@contextlib.contextmanager
def gradient_sync(model, enabled):
    """Accumulation micro-steps skip communication: FSDP keeps unsharded grads and skips the
    reduce-scatter (more memory until the last micro-step); DDP skips the all-reduce."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    elif isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
    else:
        yield


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train_step(model, optimizer, batches, cfg, device, amp_dtype, probe=None):
    """One optimizer step of grad_accum micro-steps. Returns (loss, data-wait seconds).
    probe (a dict) receives the measurements that only exist mid-step."""
    data_s, total_loss = 0.0, 0.0
    for micro in range(cfg.grad_accum):
        t0 = time.perf_counter()
        inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        data_s += time.perf_counter() - t0
        with gradient_sync(model, micro == cfg.grad_accum - 1):
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(inputs)
            if probe is not None and micro == 0:
                probe["unsharded_after_forward"] = unsharded_param_bytes(model)
            loss = loss_fn(logits, targets) / cfg.grad_accum
            loss.backward()
        total_loss += loss.detach()
    if cfg.clip:
        # On DTensor grads this computes the norm of the local shards and all-reduces it, so
        # every rank clips by the global norm.
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    optimizer.step()
    if probe is not None:
        probe.update(measure_state_bytes(model, optimizer))
    optimizer.zero_grad(set_to_none=True)
    return total_loss, data_s


def checkpoint_path(directory, step):
    return Path(directory) / f"step_{step:08d}"


def complete_checkpoints(directory):
    """step_* directories (never *.tmp) that hold DCP's .metadata, oldest first."""
    return sorted(p for p in Path(directory).glob("step_*") if p.suffix != ".tmp"
                  and (p / ".metadata").exists()) if directory else []


def latest_checkpoint(directory):
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def checkpoint_state(cfg, model, optimizer, step, rank):
    # Sharded state dicts: each rank contributes its DTensor shards; DCP records the global
    # layout, so a different world size can load them (it reads only the slices it needs).
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "step": step,
            "data": {"samples_seen": step * cfg.batch_size}, f"rng_rank{rank}": torch.get_rng_state()}


def save_checkpoint(cfg, model, optimizer, step, rank):
    """Every rank writes its shards into step_N.tmp; rank 0 renames it to step_N only after
    all ranks finished, so a crash mid-save leaves a .tmp that resume never looks at."""
    final = checkpoint_path(cfg.checkpoint_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
    dist.barrier()
    dcp.save(checkpoint_state(cfg, model, optimizer, step, rank), checkpoint_id=tmp)
    dist.barrier()  # every rank's files, and rank 0's .metadata, are on disk (fsynced by DCP)
    if rank == 0:
        maybe_crash_mid_checkpoint(cfg, step)  # fault drill: all files written, not yet renamed
        shutil.rmtree(final, ignore_errors=True)  # a rerun that saves the same step again
        record_batch_size(cfg)
        os.replace(tmp, final)  # atomic rename of the whole directory
        fd = os.open(final.parent, os.O_RDONLY)
        os.fsync(fd)  # make the rename itself durable
        os.close(fd)
        for old in complete_checkpoints(final.parent)[:-2]:
            shutil.rmtree(old)
    dist.barrier()


def load_checkpoint(cfg, model, optimizer, rank):
    """Resume from the newest complete checkpoint, at any world size. Returns the data
    position as a step count (samples seen / global batch)."""
    path = latest_checkpoint(cfg.checkpoint_dir)
    if path is None:
        return 0
    state = checkpoint_state(cfg, model, optimizer, 0, rank)
    saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if f"rng_rank{rank}" not in saved_keys:  # more ranks than the run that saved: reuse rank 0's
        state["rng_rank0"] = state.pop(f"rng_rank{rank}")
    rng_key = next(k for k in state if k.startswith("rng_rank"))
    dcp.load(state, checkpoint_id=path)  # reads this rank's slices, resharding as needed
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    torch.set_rng_state(state[rng_key])
    samples = state["data"]["samples_seen"]
    if samples % cfg.batch_size:
        raise ValueError(f"checkpoint saw {samples} samples, not a multiple of --batch-size "
                         f"{cfg.batch_size}; resume with the batch size it was trained with")
    if rank == 0:
        print(f"resumed from {path} at step {state['step']} ({samples} samples seen)", flush=True)
    return state["step"]


def full_state_dict(model):
    """All ranks all-gather every parameter; rank 0 keeps a plain fp32 CPU copy (others {})."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def export_consolidated(state, path):
    """One torch.save file of plain tensors: `TinyLlama(...).load_state_dict(torch.load(path,
    weights_only=True))` works in a single process, with no torch.distributed at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train_reference(cfg, world_size, device):
    """The single-process run the sharded one must match: same init, and each step
    accumulates every rank's micro-batches in one process (the mean gradient of the global
    batch, which reduce-scatter / all-reduce compute), with no communication at all."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg).to(device)
    model.init_weights(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    streams = [micro_batches(cfg, r, world_size, 0) for r in range(world_size)]

    def rank_major_micro_batches():
        while True:
            for stream in streams:
                for _ in range(cfg.grad_accum):
                    yield next(stream)

    batches = rank_major_micro_batches()
    accumulate_all = argparse.Namespace(**{**vars(cfg), "grad_accum": world_size * cfg.grad_accum})
    losses = []
    for step in range(1, cfg.steps + 1):
        set_learning_rate([optimizer], cfg, step)
        losses.append(train_step(model, optimizer, batches, accumulate_all, device, None)[0].item())
    return model, losses


def check_parity(cfg, full_state, world_size, device):
    reference, ref_losses = train_reference(cfg, world_size, device)
    max_diff = max((full_state[name].to(device) - param).abs().max().item()
                   for name, param in reference.named_parameters())
    return max_diff, ref_losses


def build(cfg, world_size, device):
    """Model, optimizer and the layout report for --strategy."""
    if cfg.strategy != "fsdp":
        model = build_replicated_model(cfg, device)
        return model, build_optimizer(cfg, model), None, None
    mesh = build_mesh(cfg, device, world_size)
    model = build_fsdp_model(cfg, mesh, device)
    return model, build_optimizer(cfg, model), mesh, inspect_fsdp(model, mesh, cfg)


def train(cfg, rank, world_size, device):
    torch.manual_seed(cfg.seed)
    model, optimizer, mesh, layout = build(cfg, world_size, device)
    start_step = load_checkpoint(cfg, model, optimizer, rank) if cfg.checkpoint_dir else 0
    # --amp is autocast (as in lab01); --mixed-precision is FSDP's own policy. With bf16
    # params, autocast adds little: the matmuls already run in bf16.
    amp_dtype = torch.bfloat16 if resolve_amp(cfg, device.type) == "bf16" else None
    batches = micro_batches(cfg, rank, world_size, start_step)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    last_step = cfg.stop_at_step or cfg.steps
    losses, step_times, data_times, probe = [], [], [], {}
    if rank == 0:
        num_params = sum(p.numel() for p in model.parameters())
        print(f"{LAB_NAME} | {dist.get_backend()} x{world_size} | {device} | {cfg.strategy} | "
              f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh else '-'} | "
              f"{num_params:,} params | steps {start_step + 1}..{last_step}", flush=True)
    preemption = PreemptionWatch()
    for step in range(start_step + 1, last_step + 1):
        maybe_inject_failure(cfg, step, rank)
        maybe_stall(cfg, step, rank, preemption)
        t0 = time.perf_counter()
        set_learning_rate([optimizer], cfg, step)
        loss, data_s = train_step(model, optimizer, batches, cfg, device, amp_dtype,
                                  probe if step == start_step + 1 else None)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the mean loss over all ranks
        step_s = seconds_since(t0, device)
        losses.append([step, loss.item()])
        step_times.append(step_s)
        data_times.append(data_s)
        if rank == 0 and (step % cfg.log_every == 0 or step == last_step):
            print(log_line(step, loss.item(), step_s, tokens_per_step / step_s,
                           data_s / step_s, peak_memory_bytes(device)), flush=True)
        preempted = preemption.agreed(device)
        if cfg.checkpoint_dir and ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                                   or step == last_step or preempted):
            save_checkpoint(cfg, model, optimizer, step, rank)
        if preempted:
            if rank == 0:
                print(f"preempted: checkpoint at step {step} written, exiting "
                      f"{PREEMPTED_EXIT_CODE}", flush=True)
            teardown_distributed()
            sys.exit(PREEMPTED_EXIT_CODE)
    report = {"layout": layout, "mesh": mesh, "probe": probe, "step_times": step_times,
              "data_times": data_times}
    return model, losses, step_times, report


def gather_report(model, report, world_size, device):
    """Per-rank measurements, gathered to every rank (rank 0 writes them)."""
    mine = {**report["probe"], "peak": peak_memory_bytes(device),
            "data_share": sum(report["data_times"]) / max(sum(report["step_times"]), 1e-9)}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    per_rank = {k: [r.get(k) for r in everyone] for k in mine}
    mesh = report["mesh"]
    return {
        "state_bytes_per_rank": {k: per_rank.get(k) for k in ("params", "grads", "optimizer")},
        "unsharded_param_bytes_after_forward": per_rank.get("unsharded_after_forward"),
        "peak_mem_bytes_per_rank": per_rank["peak"], "data_share_per_rank": per_rank["data_share"],
        "num_params": sum(p.numel() for p in model.parameters()),
        "param_shapes": {n: list(p.shape) for n, p in model.named_parameters()},
        "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh else None,
        "layout": report["layout"],
    }


def run(cfg, rank, world_size, device, wall_start):
    """Train, check parity, report. Every model (and DDP reducer) lives and dies in here."""
    model, losses, step_times, report = train(cfg, rank, world_size, device)
    extra = gather_report(model, report, world_size, device)
    needs_full = cfg.check_parity or cfg.export
    full_state = full_state_dict(model) if needs_full else None  # a collective: all ranks
    parity, ref_losses = None, None
    if cfg.check_parity and rank == 0:
        parity, ref_losses = check_parity(cfg, full_state, world_size, device)
    if cfg.export and rank == 0:
        export_consolidated(full_state, cfg.export)
    dist.barrier()  # the other ranks wait (within --timeout-s) for rank 0's reference
    if rank == 0:
        steady = step_times[1:] or step_times
        peaks = extra.pop("peak_mem_bytes_per_rank")
        metrics = {
            "lab": LAB_NAME, "backend": dist.get_backend(), "device": device.type,
            "world_size": world_size, "steps": losses[-1][0] if losses else 0,
            "final_loss": losses[-1][1] if losses else float("nan"), "losses": losses,
            "reference_losses": ref_losses, "parity_max_abs_diff": parity,
            "parity_tol": cfg.parity_tol,
            "tokens_per_s": cfg.batch_size * cfg.seq_len * len(steady) / sum(steady),
            "peak_mem_bytes_per_rank": peaks,
            "peak_mem_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss",
            "wall_time_s": time.perf_counter() - wall_start,
            "torch_version": torch.__version__, "config": vars(cfg),
            "strategy": cfg.strategy, "first_step_s": step_times[0] if step_times else None,
            **extra,
        }
        if cfg.metrics_out:
            write_json_atomic(cfg.metrics_out, metrics)
        print(summary_line(metrics), flush=True)
        if parity is not None and parity > cfg.parity_tol:
            sys.exit(f"parity check failed: max |param diff| {parity:.2e} > {cfg.parity_tol:.0e}")


# --8<-- [start:main]
def main(argv=None):
    cfg = parse_config(argv)
    wall_start = time.perf_counter()
    rank, world_size, device = init_distributed(cfg)
    try:
        run(cfg, rank, world_size, device, wall_start)
    except BaseException as exc:
        # A traceback keeps run()'s models alive; free them before the group goes.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main()
# --8<-- [end:main]
