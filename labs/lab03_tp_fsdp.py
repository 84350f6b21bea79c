"""Lab 03: 2D parallelism, tensor parallel (TP) inside a node and FSDP across nodes.

What it teaches: a 2D DeviceMesh ("dp", "tp"). Inside each transformer block the Megatron-LM
plan splits attention by heads and the MLP by its hidden width (column-parallel, then
row-parallel), so the ranks of one "tp" group share every matmul and exchange activations
several times per block: fast links only. Then fully_shard shards the TP-sharded weights again
over "dp", whose ranks exchange only FSDP's all-gathers and reduce-scatters: that traffic can
cross nodes. --sequence-parallel also shards the norms and residual stream on the sequence dim;
--loss-parallel computes the loss on vocab-sharded logits. `--check-parity` retrains the same
global batches in one process and compares every parameter in fp32 (max |diff| <= 1e-5; about
3e-7 here). That needs the learning-rate warmup (`learning_rate()`): TP reorders
floating-point sums, and AdamW's first step is lr * g / (|g| + eps), about lr * sign(g) for
any entry well above eps = 1e-8, so a tiny gradient whose sign is rounding noise ends up to
2 x lr away (1.5e-4 measured with `--warmup-steps 0`; `--parity-dtype float64` shows it is
rounding, not a bug). `--count-comms` counts one step's collectives by type with
CommDebugMode, and the activation bytes saved for backward.

Launch (the same file everywhere; the backend follows the hardware):
    torchrun --nproc-per-node 2 labs/lab03_tp_fsdp.py --check-parity        # mesh (1, 2)
    torchrun --nproc-per-node 4 labs/lab03_tp_fsdp.py --sequence-parallel \\
        --loss-parallel --count-comms                                       # mesh (2, 2)
    python labs/lab03_tp_fsdp.py --tp 1                                     # 1 process
    torchrun --nproc-per-node 8 labs/lab03_tp_fsdp.py --tp 4 --sequence-parallel  # 8 GPUs
    # two nodes of 8 GPUs: tp 8 inside each node, dp 2 across (mesh (2, 8)); run on each node:
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29400 --rdzv-id $JOB_ID labs/lab03_tp_fsdp.py --tp 8

Minimum world size: 1 (--tp defaults to 2 on an even world size, else 1). Expected last line
of the first command (numbers vary slightly with hardware):
    done | lab03_tp_fsdp | gloo x2 | 40 steps | loss 0.46... | parity 3.6e-07 | ...
Lesson: lessons/03_tp_fsdp.py. Runbooks: runbooks/ (OOM, NCCL hangs).

Use it in your project:
  - Replace: the keys of `block_plan()` and `root_plan()` with your module names
    (`check_plan_keys()` makes a key that matches nothing an error; parallelize_module only
    warns); `build_model()`; `init_sharded_weights()`; `SyntheticSequences`; `loss_fn()`.
  - Keep: `apply_tp()` before `apply_fsdp()` (FSDP shards the TP shards again, over "dp");
    "tp" as the last axis in `build_mesh()`, so a TP group is consecutive ranks of one node:
    `--tp` at most the GPUs per node; data split over "dp" only (TP ranks need the same
    batch); the per-mesh `clip_grad_norm_()`; DCP checkpoints (load into another mesh shape);
    the warmup in `learning_rate()` (without it, fp32 parity with TP fails by ~1e-4).
  - Pitfalls: `--tp` must divide the heads, `--dim`, the MLP width, `--vocab-size` (and
    `--seq-len` with SP), see `validate_tp()`. Attention must take its head count from the
    local width, as `Attention` does. With SP, a norm left out of the plan trains, wrongly
    (`--check-parity` after 10 steps: 2.6e-2, not 1.2e-7). full_tensor and unshard are
    collectives: call them on every rank, as `check_parity()` does (runbooks/collective-timeout.md).
"""

import argparse
import contextlib
import datetime
import gc
import inspect
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
from collections import Counter
from fnmatch import fnmatch
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)
from torch.utils.data import DataLoader, Dataset, DistributedSampler

LAB_NAME = "lab03_tp_fsdp"


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
    parser.set_defaults(micro_batch_size=16)  # per TP group: the 2 ranks of a tp=2 group share it
    arg = parser.add_argument
    arg("--tp", type=int, default=0,
        help="tensor-parallel degree: ranks per TP group (keep it inside a node); dp = world / "
             "tp (0: 2 when the world size is even, else 1)")
    arg("--sequence-parallel", action="store_true",
        help="shard norms and the residual stream on the sequence dim (TP all-reduces become "
             "all-gather + reduce-scatter pairs)")
    arg("--loss-parallel", action="store_true",
        help="cross-entropy on vocab-sharded logits instead of all-gathering the logits")
    arg("--parity-dtype", choices=["float32", "float64"], default="float32",
        help="dtype of this run and the reference under --check-parity: float64 removes "
             "rounding, to tell a bug (a gap in both) from rounding (a gap in float32 only)")
    arg("--count-comms", action="store_true",
        help="measure step 1: collectives by type (CommDebugMode) and saved activation bytes")
    cfg = parser.parse_args(argv)
    world_size = world_size_from_env()
    cfg.tp = cfg.tp or (2 if world_size % 2 == 0 else 1)
    validate_tp(cfg, world_size)
    validate_common(cfg, world_size, dp_size=world_size // cfg.tp)
    return cfg


def validate_tp(cfg, world_size):
    """TP splits heads, the model and MLP widths, the vocabulary and (with SP) the sequence
    into tp equal slices; each must divide evenly, and tp must divide the world."""
    if cfg.tp < 0:
        fail_config("--tp", f"must be >= 0, got {cfg.tp}")
    if world_size % cfg.tp:
        divisors = [t for t in range(1, world_size + 1) if world_size % t == 0]
        fail_config("--tp", f"{cfg.tp} does not divide the world size {world_size} (the mesh is "
                    f"(dp, tp) = (world / tp, tp)); allowed: {', '.join(map(str, divisors))}")
    sizes = {"--num-heads": cfg.num_heads, "--dim": cfg.dim, "--dim x 4 (MLP width)": 4 * cfg.dim,
             "--vocab-size": cfg.vocab_size}
    if cfg.sequence_parallel:
        sizes["--seq-len (with --sequence-parallel)"] = cfg.seq_len
    for flag, size in sizes.items():
        if size % cfg.tp:
            allowed = [t for t in range(1, world_size + 1)
                       if world_size % t == 0 and all(s % t == 0 for s in sizes.values())]
            fail_config("--tp", f"{cfg.tp} does not divide {flag} = {size}: each TP rank needs "
                        f"an equal slice; allowed: {', '.join(map(str, allowed))}")


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

# The point of the lab: a 2D mesh, the TP plan per block, then FSDP over "dp".
def build_mesh(cfg, world_size, device):
    # "tp" is the last, fastest-varying axis: a TP group is tp consecutive ranks, which torchrun
    # places on one node (NVLink). "dp" strides across nodes and carries only FSDP's traffic.
    return init_mesh(device.type, (world_size // cfg.tp, cfg.tp), ("dp", "tp"),
                     datetime.timedelta(seconds=cfg.timeout_s))


def block_plan(cfg):
    """TP plan of one block, keys relative to the block. Megatron-LM (arXiv:1909.08053 sec. 3):
    column-parallel then row-parallel, so each half of the block needs one collective forward
    and one backward. Sequence parallel: arXiv:2205.05198."""
    between = Shard(1) if cfg.sequence_parallel else Replicate()  # activations between blocks

    def gather_input():
        # SP: all-gather the sequence (backward: reduce-scatter). No SP: nothing forward, and in
        # backward ONE all-reduce of the input grad (Megatron's "f"). use_local_output=False
        # hands wq/wk/wv (w1/w3) the same DTensor, so they share that one collective.
        return PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                  use_local_output=False)

    plan = {
        "attention": gather_input(),
        # Colwise = split output features = split heads: num_heads / tp heads per rank. Attention
        # infers its head count from the width (view(..., -1, head_dim)): nothing to adjust.
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        # Rowwise: each rank holds partial sums of the output. All-reduce them (Megatron's "g"),
        # or with SP reduce-scatter them straight into the sequence-sharded layout.
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward": gather_input(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
    }
    if cfg.sequence_parallel:
        # RMSNorm is per token: each rank normalises its own tokens. Its weight is replicated
        # but sees only local tokens, so backward all-reduces its gradient (as Megatron-LM does
        # for LayerNorm weights under SP): one small all-reduce per norm.
        plan.update(attention_norm=SequenceParallel(), ffn_norm=SequenceParallel())
    return plan


def root_plan(cfg):
    """Embedding, final norm and output projection: handled explicitly, outside the blocks."""
    between = Shard(1) if cfg.sequence_parallel else Replicate()
    plan = {
        # Vocab-sharded table: each rank looks up the rows it owns (zeros elsewhere), then the
        # partial sums are all-reduced (SP: reduce-scattered over the sequence).
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # Vocab-sharded projection. Loss parallel keeps logits sharded: cross-entropy then
        # all-reduces per-token statistics only, never the (batch, seq, vocab) logits.
        "output": ColwiseParallel(input_layouts=between,
                                  output_layouts=Shard(-1) if cfg.loss_parallel else Replicate(),
                                  use_local_output=not cfg.loss_parallel),
    }
    if cfg.sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


def check_plan_keys(module, plan):
    """parallelize_module only warns about a key that matches no submodule, and leaves that
    layer whole on every rank: memory silently not saved, or a shape error far from the typo."""
    names = [name.split(".") for name, _ in module.named_modules() if name]
    for key in plan:
        tokens = key.split(".")  # matched token by token with fnmatch, as parallelize_module does
        if not any(len(n) == len(tokens) and all(map(fnmatch, n, tokens)) for n in names):
            raise ValueError(f"TP plan key {key!r} matches no submodule of "
                             f"{type(module).__name__}")


def apply_tp(model, tp_mesh, cfg):
    # Per block: plan keys are relative to the module passed in, and one block's plan is the
    # unit of the Megatron analysis. Then the root's own modules.
    for block in model.layers.values():
        plan = block_plan(cfg)
        check_plan_keys(block, plan)
        parallelize_module(block, tp_mesh, plan)
    plan = root_plan(cfg)
    check_plan_keys(model, plan)
    parallelize_module(model, tp_mesh, plan)


def apply_fsdp(model, dp_mesh, cfg, device):
    # After TP, not before: parallelize_module turns plain parameters into tp-sharded DTensors,
    # fully_shard then shards those again over "dp" (2D placements). FSDP's all-gather over "dp"
    # rebuilds exactly the tp-local shard that TP's hooks expect. Each block is one FSDP unit:
    # all-gather before forward, again before backward, one reduce-scatter of its gradients.
    bf16 = resolve_amp(cfg, device.type) == "bf16"
    mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if bf16 else MixedPrecisionPolicy())
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)  # root: embeddings, norm, output


@torch.no_grad()
def init_sharded_weights(model, seed):
    """Each shard gets its slice of initial_value(name, full shape): the same weights for every
    mesh shape. Every rank builds the full tensor and keeps its piece; a large model would
    generate only the local shard."""
    # src_data_rank=None (torch >= 2.7): slice locally. Before, rank 0 scatters an identical copy.
    local_only = ({"src_data_rank": None} if "src_data_rank" in
                  inspect.signature(distribute_tensor).parameters else {})
    for name, param in model.named_parameters():
        full = initial_value(name, param.shape, seed).to(param.device)
        shard = distribute_tensor(full, param.device_mesh, param.placements, **local_only)
        param.to_local().copy_(shard.to_local())


def param_dtype(cfg):
    return torch.float64 if cfg.check_parity and cfg.parity_dtype == "float64" else torch.float32


def build_parallel_model(cfg, mesh, device):
    with torch.device("meta"):  # no full copy of the model on any rank
        model = build_model(cfg).to(param_dtype(cfg))
    apply_tp(model, mesh["tp"], cfg)
    apply_fsdp(model, mesh["dp"], cfg, device)
    model.to_empty(device=device)
    init_sharded_weights(model, cfg.seed)
    return model


def inspect_tp_fsdp(model, cfg, tp_size):
    """What a rank holds. Sharded: 2D placements, about 1/world of each TP'd weight. Unsharded
    (FSDP all-gathered over dp), the tp-local slice that the matmuls use."""
    block = model.layers["0"]
    wq = block.attention.wq.weight
    assert wq.device_mesh.mesh_dim_names == ("dp", "tp") and wq.shape == (cfg.dim, cfg.dim), wq
    dp_size = wq.device_mesh["dp"].size()  # FSDP splits the tp-local rows again, in dp chunks
    assert wq.to_local().shape[0] <= -(-cfg.dim // tp_size // dp_size), wq.to_local().shape
    block.unshard()  # FSDP all-gather over "dp"
    tp_local = block.attention.wq.weight
    assert tp_local.placements == (Shard(0),), tp_local.placements
    local_width = tp_local.to_local().shape[0]  # output features of wq on this rank
    assert local_width == cfg.dim // tp_size, (local_width, cfg.dim, tp_size)
    block.reshard()
    head_dim = cfg.dim // cfg.num_heads
    return {"wq_placements": str(wq.placements), "wq_tp_local_width": local_width,
            "local_heads": local_width // head_dim}


def local_bytes(tensors):
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


class CommCounter(CommDebugMode):
    """CommDebugMode counts collectives by type (and per module); this also counts the bytes
    each rank sends for them, with lesson 00's ring factors for a group of n ranks and a full
    tensor of S bytes (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter:
    the unreduced input): all-reduce 2 (n-1)/n x S, all-gather and reduce-scatter (n-1)/n x S.
    TP's collectives come from DTensor as c10d_functional.* ops, which see only the local
    input (for an all-gather: one shard, S / n); FSDP's and the loss average come as c10d.*
    ops, which see both buffers. Counting wire bytes, not "the largest argument", is what
    makes the two comparable."""

    def __init__(self, groups):
        """groups: {label: ProcessGroup}, every group the step may use (a mesh axis each)."""
        super().__init__()
        self.groups = {g.group_name: (label, g.size()) for label, g in groups.items()}
        self.wire_bytes = Counter()           # by op
        self.wire_bytes_by_group = Counter()  # by (group label, op)

    def group_of(self, args):
        for a in args:
            if isinstance(a, str) and a in self.groups:  # functional: the group's name
                return self.groups[a]
            if isinstance(a, torch.ScriptObject):  # c10d: the ProcessGroup itself
                with contextlib.suppress(RuntimeError):  # (the ReduceOp is one too)
                    return self.groups[dist.ProcessGroup.unbox(a).group_name]
        raise ValueError(f"none of the groups given is among the arguments: {args}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = Counter(self.comm_counts)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for op in Counter(self.comm_counts) - before:
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            (label, n), largest, name = self.group_of(args), max(t.nbytes for t in tensors), str(op)
            if "all_reduce" in name or "allreduce" in name:
                sent = 2 * (n - 1) / n * largest
            elif name == "c10d_functional.all_gather_into_tensor":  # its input is one shard
                sent = (n - 1) * largest
            elif "gather" in name or "scatter" in name:
                sent = (n - 1) / n * largest
            else:
                sent = largest
            self.wire_bytes[name] += int(sent)
            self.wire_bytes_by_group[f"{label} {name}"] += int(sent)
        return out

    def block_counts(self, block_name):
        found = [v for k, v in self.comm_module_counts.items() if k.endswith(block_name)]
        assert len(found) == 1, (block_name, list(self.comm_module_counts))
        return {phase: {str(op): n for op, n in found[0][phase].items()}
                for phase in ("forward", "backward")}


class SavedActivationBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd keeps for backward on this rank (storages counted once; parameters and
    their views excluded): the activation memory that TP and SP divide."""

    def __init__(self, model):
        self.total, seen = 0, set()

        def storage_key(tensor):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            try:
                storage = local.untyped_storage()
                return storage.data_ptr(), storage.nbytes()
            except RuntimeError:  # a wrapper (an in-flight collective's result) has no storage
                return id(local), local.nbytes

        def pack(tensor):
            key, nbytes = storage_key(tensor)
            if key not in seen and key not in {storage_key(p)[0] for p in model.parameters()}:
                seen.add(key)
                self.total += nbytes
            return tensor

        super().__init__(pack, lambda tensor: tensor)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm):
    """clip_grad_norm_ for gradients on different meshes: without SP the norm weights live on
    "dp" only, the TP'd weights on ("dp", "tp"), and one torch.stack cannot mix meshes. Sum
    squares per mesh (full_tensor() all-reduces a DTensor norm over its mesh), then combine.

    On the 2-D mesh, full_tensor() reduces one axis after the other, and DTensor logs (once)
    "2 sequential all_reduce operations will be performed ... flatten mesh dimensions". It is a
    latency hint: each all-reduce carries one scalar, once per step. The result is the same on
    every rank, because each all-reduce hands all members of a group the same bits and the
    second one sums values that the first already made equal across "dp"."""
    groups = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups.values()]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total_norm = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm


def checkpoint_path(directory, step):
    return Path(directory) / f"step_{step:08d}"


def latest_checkpoint(directory):
    """Newest complete checkpoint: step_NNNNNNNN directories appear only by rename after DCP
    wrote every shard and its .metadata; half-written ones end in .tmp and never match."""
    found = sorted(p for p in Path(directory).glob("step_" + "?" * 8)
                   if (p / ".metadata").is_file()) if directory else []
    return found[-1] if found else None


def save_checkpoint(cfg, model, optimizer, step, rank):
    final = checkpoint_path(cfg.checkpoint_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a run that died mid-save
    dist.barrier()
    # Every rank writes only its own shards (no gather to rank 0); the file names record each
    # shard's global offsets, so any other mesh shape can load it. RNG state is not saved:
    # nothing here draws random numbers after init, and the data order is a function of step.
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    if rank == 0:  # dcp.save returns on every rank only after rank 0 wrote .metadata
        maybe_crash_mid_checkpoint(cfg, step)  # fault drill: the shards exist, the name does not
        shutil.rmtree(final, ignore_errors=True)
        record_batch_size(cfg)
        os.replace(tmp, final)  # atomic: readers see no directory or a complete one
        for old in sorted(final.parent.glob("step_" + "?" * 8))[:-2]:
            shutil.rmtree(old)
    dist.barrier()  # nobody races ahead while rank 0 is still renaming


def load_checkpoint(cfg, model, optimizer, rank):
    path = latest_checkpoint(cfg.checkpoint_dir)
    if path is None:
        return 0
    # Resharding on load: each rank asks for the slices its own (dp, tp) placements cover, and
    # DCP reads them from whichever shard files hold them. The mesh may differ from the saver's.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    step = int(path.name.split("_")[1])
    if rank == 0:
        print(f"resumed from {path} at step {step}", flush=True)
    return step


def loss_fn(logits, targets):
    logits = logits.flatten(0, 1)  # in fp32 at least (bf16 logits lose the loss's precision)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                           targets.flatten())


def train_step(model, optimizer, batches, cfg, device, parallel_loss, step, probe=None):
    """Optimizer step `step` (1-based), of grad_accum micro-steps. Returns (loss, data-wait
    seconds)."""
    data_s, total_loss = 0.0, 0.0
    # bf16: FSDP already gathers bf16 weights. Autocast is kept as in lab01 (--amp); it once
    # also stopped the fp32 RoPE tables promoting q and k, which apply_rope's type_as now does.
    bf16 = resolve_amp(cfg, device.type) == "bf16"
    for micro in range(cfg.grad_accum):
        t0 = time.perf_counter()
        inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        data_s += time.perf_counter() - t0
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2's no_sync: reduce-scatter
            model.set_requires_gradient_sync(micro == cfg.grad_accum - 1)  # on the last only
        # loss_parallel must cover the backward too: it swaps in the sharded loss's gradient.
        with loss_parallel() if parallel_loss else contextlib.nullcontext():
            with probe if probe and micro == 0 else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = model(inputs)
                loss = loss_fn(logits, targets) / cfg.grad_accum
            loss.backward()
        loss = loss.detach()
        total_loss += loss.to_local() if isinstance(loss, DTensor) else loss
    if cfg.clip:
        clip_grad_norm_(model.parameters(), cfg.clip)
    set_learning_rate([optimizer], cfg, step)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total_loss, data_s


def train_reference(cfg, dp_size, device):
    """The single-process run that the 2D run must match: same init, and each step accumulates
    the gradients of every dp rank's micro-batches in one process (TP ranks share a batch)."""
    model = build_model(cfg).to(device, param_dtype(cfg))
    model.init_weights(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    streams = [micro_batches(cfg, r, dp_size, 0) for r in range(dp_size)]

    def rank_major_micro_batches():
        while True:
            for stream in streams:
                for _ in range(cfg.grad_accum):
                    yield next(stream)

    batches = rank_major_micro_batches()
    accumulate_all = argparse.Namespace(**{**vars(cfg), "grad_accum": dp_size * cfg.grad_accum})
    losses = [train_step(model, optimizer, batches, accumulate_all, device, False, step)[0].item()
              for step in range(1, cfg.steps + 1)]
    return model, losses


def check_parity(cfg, model, rank, dp_size, device):
    # Collectives, so every rank takes part: FSDP's all-gather over "dp" gives the tp-local
    # weights, then full_tensor() all-gathers those over "tp".
    for module in [*model.layers.values(), model]:
        module.unshard()
    full = [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for p in model.parameters()]
    if rank != 0:
        return None, None
    reference, ref_losses = train_reference(cfg, dp_size, device)
    max_diff = max((p - q).abs().max().item() for p, q in zip(full, reference.parameters()))
    return max_diff, ref_losses


def count_first_step(cfg, model, optimizer, batches, device, rank, world_size, step, mesh):
    """The run's first step under CommCounter and SavedActivationBytes: what one step costs
    a rank."""
    groups = {"dp": mesh["dp"].get_group(), "tp": mesh["tp"].get_group(), "world": dist.group.WORLD}
    counter, saved = CommCounter(groups), SavedActivationBytes(model)
    with counter:
        loss, data_s = train_step(model, optimizer, batches, cfg, device, cfg.loss_parallel,
                                  step, probe=saved)
    activations = [None] * world_size
    dist.all_gather_object(activations, saved.total)
    return loss, data_s, {
        "activation_bytes_per_rank": activations,
        "comm_counts_per_step": {str(op): n for op, n in counter.comm_counts.items()},
        "comm_wire_bytes_per_step": dict(counter.wire_bytes),
        "comm_wire_bytes_per_step_by_group": dict(counter.wire_bytes_by_group),
        "comm_counts_block0": counter.block_counts("layers.0")}


def train(cfg, rank, world_size, device):
    mesh = build_mesh(cfg, world_size, device)
    dp_size, tp_size = mesh["dp"].size(), mesh["tp"].size()
    model = build_parallel_model(cfg, mesh, device)
    extra = {"mesh": [dp_size, tp_size], **inspect_tp_fsdp(model, cfg, tp_size)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    start_step = load_checkpoint(cfg, model, optimizer, rank)
    # TP ranks must see the same batch: data is split over "dp" only.
    batches = micro_batches(cfg, mesh["dp"].get_local_rank(), dp_size, start_step)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    last_step = cfg.stop_at_step or cfg.steps
    losses, step_times, data_times = [], [], []
    if rank == 0:
        print(f"{LAB_NAME} | {dist.get_backend()} x{world_size} | {device} | mesh (dp, tp) = "
              f"({dp_size}, {tp_size}) | sp {cfg.sequence_parallel} | loss parallel "
              f"{cfg.loss_parallel} | {str(param_dtype(cfg))[6:]} | "
              f"steps {start_step + 1}..{last_step}", flush=True)
    preemption = PreemptionWatch()
    for step in range(start_step + 1, last_step + 1):
        maybe_inject_failure(cfg, step, rank)
        maybe_stall(cfg, step, rank, preemption)
        t0 = time.perf_counter()
        if step == start_step + 1 and cfg.count_comms:
            loss, data_s, counts = count_first_step(cfg, model, optimizer, batches, device,
                                                    rank, world_size, step, mesh)
            extra.update(counts)
        else:
            loss, data_s = train_step(model, optimizer, batches, cfg, device, cfg.loss_parallel,
                                      step)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # mean over dp (tp ranks agree already)
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
    state = [None] * world_size
    dist.all_gather_object(state, {"params": local_bytes(model.parameters()),
                                   "optimizer": local_bytes(t for s in optimizer.state.values()
                                                            for t in s.values())})
    extra["state_bytes_per_rank"] = state
    shares = [None] * world_size  # a straggler shows up as one rank with a high data-wait share
    dist.all_gather_object(shares, sum(data_times) / max(sum(step_times), 1e-9))
    extra["data_share_per_rank"] = shares
    return model, losses, step_times, dp_size, extra


def run(cfg, rank, world_size, device, wall_start):
    """Train, check parity, report. Every model (and DDP reducer) lives and dies in here."""
    model, losses, step_times, dp_size, extra = train(cfg, rank, world_size, device)
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak_memory_bytes(device))
    parity, ref_losses = None, None
    if cfg.check_parity:
        parity, ref_losses = check_parity(cfg, model, rank, dp_size, device)
    dist.barrier()  # the other ranks wait (within --timeout-s) for rank 0's reference
    if rank == 0:
        steady = step_times[1:] or step_times
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
            "torch_version": torch.__version__, "config": vars(cfg), **extra,
        }
        if cfg.metrics_out:
            write_json_atomic(cfg.metrics_out, metrics)
        print(summary_line(metrics), flush=True)
        if parity is not None and parity > cfg.parity_tol:
            sys.exit(f"parity check failed: max |param diff| {parity:.2e} > "
                     f"{cfg.parity_tol:.0e}")


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
