"""Lab 07: context parallelism (ring attention) composed with FSDP2, for long sequences.

What it teaches: every rank holds 1/cp of each sequence (the head-tail split by default: chunks
r and 2cp-1-r of 2cp, which evens out causal attention's work) and runs the whole model on
those tokens. Only attention needs the rest of the sequence: its key/value slices travel around
the ranks of the "cp" axis with send/recv (ring attention, by hand), and a log-sum-exp merge
combines the partial results, forward and backward. Parameters are sharded with fully_shard
over all ranks (the dp x cp mesh flattened, as torchtitan's dp_shard_cp axis), so each rank's
gradients are averaged over every token of the global batch. `--check-parity` retrains the same
global batches in one process with plain attention over whole sequences and compares every
parameter (fp32 on CPU: max |diff| must be <= 1e-5).

Launch (the same file everywhere; the backend follows the hardware):
    python labs/lab07_context_parallel.py                                  # 1 process, cp 1
    torchrun --nproc-per-node 2 labs/lab07_context_parallel.py --check-parity   # cp 2
    torchrun --nproc-per-node 4 labs/lab07_context_parallel.py --cp 2 --check-parity  # dp 2 x cp 2
    torchrun --nproc-per-node 4 labs/lab07_context_parallel.py --layout contiguous  # the naive split
    python labs/lab07_context_parallel.py --plan --model 8b --seq-len 131072 --nproc 8 --cp 8 --gpu H100-80GB
    # two nodes (run on each; same --rdzv-id everywhere, node 0's address as the endpoint;
    # --checkpoint-dir must be on a filesystem both nodes share; keep the cp ring in a node):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29400 --rdzv-id $JOB_ID labs/lab07_context_parallel.py --cp 8

Minimum world size: 1 (cp 1 is plain FSDP). Expected last line of the --check-parity run at 2
ranks (numbers vary slightly with hardware; the default global batch is 8 sequences per
data-parallel rank, so the loss depends on the layout unless --batch-size is given):
    done | lab07_context_parallel | gloo x2 | 40 steps | loss 0.91... | parity 3.6e-07 | ...
Tested on torch 2.13. The ring is by hand (lessons/07_context_parallel.py derives it): on GPUs
torch's own `context_parallel` (prototype, CUDA attention kernels only) runs fused flash
attention instead; this lab's ring computes each block in fp32 with plain matmuls.
Lesson: lessons/07_context_parallel.py. Runbooks: runbooks/ (hangs, OOM).

Use it in your project:
  - Replace: `build_model()` (run on the meta device by `build_fsdp_model()`); the attention
    class `apply_context_parallel()` swaps in (yours needs the same global RoPE positions and
    the ring in place of SDPA); `SyntheticSequences`; `loss_fn()`.
  - Keep: `shard_sequence()` on inputs and targets with the same layout the attention uses;
    the ring's `rotate()` (both directions posted together, peers as global ranks);
    `build_mesh()`'s two meshes (cp groups for the ring, all ranks for fully_shard); DCP
    `save_checkpoint()` / `load_checkpoint()` (tmp dir, then rename; any world size).
  - Pitfalls: RoPE must use each token's global position (`sequence_positions()`), not its
    local index. Every rank of a cp group must run every step of `rotate()`, even one with
    no visible block, or its neighbour waits until --timeout-s
    (runbooks/collective-timeout.md). With causal attention the contiguous split leaves the
    last rank the most work (--layout contiguous shows it). Out of memory at long sequences:
    a larger --cp, then --activation-checkpointing (runbooks/oom-mitigations.md).
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
import tempfile
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
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

LAB_NAME = "lab07_context_parallel"


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
    arg("--model", choices=list(MODEL_PRESETS), default="debug",
        help="Llama-shaped size preset (MODEL_PRESETS): debug (the CPU default), small, 1b "
             "(Llama-3.2-1B's shape), 8b (Llama-3.1-8B's), 70b (Llama-3.1-70B's); the flags "
             "below override its fields")
    arg("--micro-batch-size", type=int, default=None,
        help="sequences per data-parallel rank per micro-step (default: the preset's); sets "
             "the default --batch-size")
    arg("--batch-size", type=int, default=0,
        help="global batch, in sequences per optimizer step (0: --micro-batch-size x "
             "data-parallel ranks x --grad-accum, so the defaults work at any world size)")
    arg("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    arg("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    arg("--dim", type=int, default=None, help="model width (default: the preset's)")
    arg("--num-layers", type=int, default=None, help="transformer blocks (default: the preset's)")
    arg("--num-heads", type=int, default=None, help="attention heads (default: the preset's)")
    arg("--num-kv-heads", type=int, default=None,
        help="key/value heads, grouped-query attention (default: the preset's; debug: no GQA)")
    arg("--ffn-dim", type=int, default=None,
        help="SwiGLU hidden width (default: the preset's; debug: 4 x --dim)")
    arg("--vocab-size", type=int, default=None,
        help="vocabulary size (default: the preset's; 256 with a text --data file)")
    arg("--num-samples", type=int, default=512,
        help="synthetic dataset size in sequences (ignored with --data: the file sets it)")
    arg("--data", default="",
        help="train on this file instead of synthetic sequences: *.bin holds raw token ids "
             "(--data-dtype), any other file is read as bytes (vocabulary 256)")
    arg("--data-dtype", choices=["uint16", "uint32"], default="uint16",
        help="token id type of a *.bin --data file (uint16: vocabularies up to 65,536)")
    arg("--lr", type=float, default=3e-3, help="AdamW learning rate (after the warmup)")
    arg("--warmup-steps", type=int, default=5,
        help="linear learning-rate warmup from 0 over this many steps (0: none); see "
             "learning_rate()")
    arg("--clip", type=float, default=1.0, help="max gradient norm (0 disables clipping)")
    arg("--seed", type=int, default=0, help="seed for init, data order and RNG")
    arg("--device", choices=["auto", "cpu", "cuda"], default="auto",
        help="auto: cuda + nccl when every local rank has a GPU, else cpu + gloo")
    arg("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto",
        help="compute precision: auto = bf16 on a GPU that has it, fp16 with a GradScaler on "
             "one that does not, off (fp32) on cpu; see choose_precision()")
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
    arg("--plan", action="store_true",
        help="print the layout, precision and memory per rank for --nproc ranks of --gpu, "
             "then exit; starts no process group and needs no GPU")
    arg("--nproc", type=int, default=0, help="--plan: world size to plan for (0: this launch's)")
    arg("--gpu", default="",
        help="--plan: the GPU to plan for, a GPU_SPECS key such as H100-80GB (default: this "
             "machine's device)")
    # lean: begin parity reference and fault drills
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
    # lean: end


def validate_common(cfg, world_size, dp_size):
    """Checks every lab shares. dp_size: the ranks that split the batch (world size over the
    model-parallel degrees); it fills in the default --batch-size."""
    apply_model_preset(cfg)
    for name, value in vars(cfg).items():  # float("nan") passes every <= check below
        if isinstance(value, float) and not math.isfinite(value):
            fail_config(f"--{name.replace('_', '-')}", f"must be a finite number, got {value}")
    positive = ["steps", "micro_batch_size", "grad_accum", "seq_len", "dim", "num_layers",
                "num_heads", "num_kv_heads", "ffn_dim", "vocab_size", "num_samples", "lr",
                "timeout_s", "log_every"]
    for name in positive:
        if getattr(cfg, name) <= 0:
            fail_config(f"--{name.replace('_', '-')}", f"must be > 0, got {getattr(cfg, name)}")
    for name in ["batch_size", "clip", "num_workers", "checkpoint_every", "stop_at_step",
                 "warmup_steps", "nproc"]:
        if getattr(cfg, name) < 0:
            fail_config(f"--{name.replace('_', '-')}", f"must be >= 0, got {getattr(cfg, name)}")
    if cfg.dim % cfg.num_heads or (cfg.dim // cfg.num_heads) % 2:
        fail_config("--dim", f"{cfg.dim} must split into --num-heads {cfg.num_heads} even-sized heads")
    if cfg.num_heads % cfg.num_kv_heads:
        fail_config("--num-kv-heads", f"{cfg.num_kv_heads} must divide --num-heads {cfg.num_heads}")
    if cfg.plan and cfg.gpu and cfg.gpu not in GPU_SPECS:
        fail_config("--gpu", f"unknown GPU {cfg.gpu!r}; known: {', '.join(GPU_SPECS)}")
    if (cfg.nproc or cfg.gpu) and not cfg.plan:
        fail_config("--nproc" if cfg.nproc else "--gpu", "only means something with --plan")
    if cfg.data:
        validate_data_file(cfg)
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
    if dataset_length(cfg) < cfg.batch_size:
        flag = "--data" if cfg.data else "--num-samples"
        fail_config(flag, f"{dataset_length(cfg)} sequences of --seq-len {cfg.seq_len}, fewer "
                    f"than one global batch of {cfg.batch_size}")
    if cfg.stop_at_step > cfg.steps:
        fail_config("--stop-at-step", f"{cfg.stop_at_step} is beyond --steps {cfg.steps}")
    if (cfg.resume or cfg.checkpoint_every or cfg.stop_at_step) and not cfg.checkpoint_dir:
        fail_config("--checkpoint-dir", "required by --resume, --checkpoint-every and "
                    "--stop-at-step")
    validate_drill_flags(cfg, world_size)  # lean: drop
    if cfg.resume and not latest_checkpoint(cfg.checkpoint_dir):
        fail_config("--resume", f"no complete checkpoint in {cfg.checkpoint_dir}")
    if cfg.plan:
        return  # the rest is about this machine, which a plan does not need
    if cfg.checkpoint_dir:
        refuse_unwritable_directory("--checkpoint-dir", Path(cfg.checkpoint_dir))
    if cfg.metrics_out:
        refuse_unwritable_directory("--metrics-out", Path(cfg.metrics_out).parent)
    if cfg.device == "cuda" and torch.cuda.device_count() < local_world_size():
        fail_config("--device", f"cuda needs one GPU per local rank: {local_world_size()} ranks, "
                    f"{torch.cuda.device_count()} GPUs visible; use --device cpu")
    device_type = pick_device_type(cfg)
    if cfg.amp == "bf16" and device_type == "cuda" and not cuda_has_bf16():
        fail_config("--amp", f"bf16 needs an Ampere or newer GPU; {torch.cuda.get_device_name()} "
                    "has none: use --amp fp16 (or auto)")


# lean: begin the checks of the parity and drill flags
def validate_drill_flags(cfg, world_size):
    for name in ["parity_tol", "fail_at_step", "fail_rank", "crash_in_checkpoint",
                 "stall_at_step"]:
        if getattr(cfg, name) < 0:
            fail_config(f"--{name.replace('_', '-')}", f"must be >= 0, got {getattr(cfg, name)}")
    if cfg.fail_rank >= world_size:
        fail_config("--fail-rank", f"{cfg.fail_rank} is not a rank of a world of {world_size}")
    if cfg.crash_in_checkpoint and not cfg.checkpoint_dir:
        fail_config("--checkpoint-dir", "required by --crash-in-checkpoint")
    if cfg.check_parity and not cfg.plan and compute_dtype(cfg, pick_device_type(cfg)) is not None:
        fail_config("--check-parity", "needs fp32 (--amp off): bf16/fp16 rounding is far above 1e-5")
# lean: end


def refuse_unwritable_directory(flag, directory):
    """Create `directory` and write a file in it now, on every rank, so that a path that
    cannot hold the output fails here in one line, not as a traceback from every rank after
    minutes of training."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        fail_config(flag, f"cannot create or write {directory}: {err.strerror or err}")


def apply_model_preset(cfg):
    """Fill in every model field the command line left out, from the --model preset."""
    if cfg.data and not cfg.data.endswith(".bin") and cfg.vocab_size is None:
        cfg.vocab_size = 256  # a text file is read as bytes
    for name, value in MODEL_PRESETS[cfg.model].items():
        if getattr(cfg, name, None) is None:  # rope_theta has no flag: always the preset's
            setattr(cfg, name, value)
    cfg.num_kv_heads = cfg.num_kv_heads or cfg.num_heads
    cfg.ffn_dim = cfg.ffn_dim or 4 * cfg.dim


def planned_world_size(cfg):
    """--plan --nproc N plans for N ranks; everything else runs at the launch's world size."""
    return cfg.nproc if cfg.plan and cfg.nproc else world_size_from_env()


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
    arg("--cp", type=int, default=0,
        help="context-parallel degree: ranks that split each sequence (0: all ranks); the "
             "rest of the world is data parallel")
    arg("--layout", choices=["zigzag", "contiguous"], default="zigzag",
        help="how a sequence is cut over the cp ranks: zigzag (head-tail, chunks r and "
             "2cp-1-r of 2cp: even causal work) or contiguous (chunk r of cp)")
    arg("--reshard-after-forward", choices=["true", "false"], default="true",
        help="false keeps each block's gathered params from forward to backward (ZeRO-2-like)")
    arg("--mixed-precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
        help="FSDP's MixedPrecisionPolicy: params gathered and used in this dtype, grads "
             "reduced in fp32; auto = the --amp choice (bf16 on a GPU that has it, fp32 on cpu)")
    arg("--activation-checkpointing", action="store_true",
        help="recompute each block's activations in backward instead of storing them")
    arg("--cpu-offload", action="store_true",
        help="keep sharded params, grads and optimizer step on the CPU (CPUOffloadPolicy)")
    arg("--compile", action="store_true", help="torch.compile each block before sharding")
    arg("--compile-backend", default="inductor",
        help="torch.compile backend (aot_eager skips code generation; useful to bisect)")
    arg("--export", default="",
        help="write one consolidated state dict file here at the end (loads in one process)")
    cfg = parser.parse_args(argv)
    world_size = planned_world_size(cfg)
    cfg.cp = cfg.cp or world_size
    validate_layout(cfg, world_size)  # before the batch defaults, which need dp_size
    validate_common(cfg, world_size, dp_size=world_size // cfg.cp)
    plan_or_refuse(cfg, plan_layout(cfg, world_size), world_size)
    return cfg


def plan_layout(cfg, world_size):
    """What each rank holds, for estimate_memory() and --plan. A rank holds 1/cp of each of
    its sequences: micro_batch counts sequences' worth of tokens, so it is fractional here."""
    dp_size = world_size // cfg.cp
    return {"mesh": f"dp={dp_size}, cp={cfg.cp}; fully_shard over all {world_size} ranks",
            "what": f"ring attention over cp, {cfg.layout} split; fully_shard, one unit per block",
            "precision": "MixedPrecisionPolicy: params gathered in the compute dtype, grads "
                         "reduced in fp32, fp32 master shards; the ring in fp32",
            "state_shards": world_size, "optimizer_shards": world_size,
            "tp": 1, "layers": cfg.num_layers, "in_flight": 1,
            "micro_batch": cfg.batch_size / (dp_size * cfg.grad_accum) / cfg.cp,
            "fsdp": True, "ddp_buckets": False}


def fsdp_param_dtype(cfg, device_type):
    """The dtype FSDP gathers params in (None: fp32). auto follows --amp: on CUDA that is bf16,
    and it matters, because autocast over fp32 shards still all-gathers fp32 (twice the bytes)."""
    if cfg.mixed_precision == "auto":
        return compute_dtype(cfg, device_type)
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.mixed_precision]


def validate_layout(cfg, world_size):
    """The cp degree and the sequence split, checked before any process group."""
    if cfg.cp < 0 or world_size % cfg.cp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        fail_config("--cp", f"{cfg.cp} must divide the world size {world_size}; "
                    f"allowed: 0 (all ranks) or {', '.join(map(str, divisors))}")
    seq_len = cfg.seq_len or MODEL_PRESETS[cfg.model]["seq_len"]
    chunks = num_chunks(cfg.cp, cfg.layout)
    if seq_len % chunks:
        fail_config("--seq-len", f"{seq_len} must split into {chunks} equal chunks "
                    f"(--cp {cfg.cp}, --layout {cfg.layout})")
    # lean: begin the parity flag's check
    if cfg.mixed_precision in ("bf16", "fp16") and cfg.check_parity:
        fail_config("--check-parity", f"needs --mixed-precision fp32: {cfg.mixed_precision} "
                    "rounding is far above 1e-5")
    # lean: end


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


def cuda_has_bf16():
    # In hardware from Ampere (sm_80) on; V100 and T4 would emulate it, slowly.
    return torch.cuda.is_bf16_supported(including_emulation=False)


def choose_precision(requested, device_type, has_bf16):
    """--amp and the device's capabilities -> the compute dtype, None meaning fp32. Pure, so a
    test can drive it with any device it fakes."""
    if requested == "off" or (requested == "auto" and device_type != "cuda"):
        return None  # CPU: fp32 keeps parity within 1e-5, and CPU bf16 matmuls are rarely faster
    if requested == "auto":
        # bf16 has fp32's exponent range, so no loss scaling; fp16 needs a GradScaler.
        return torch.bfloat16 if has_bf16 else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[requested]


def compute_dtype(cfg, device_type):
    return choose_precision(cfg.amp, device_type, device_type != "cuda" or cuda_has_bf16())


def precision_name(dtype):
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16 + GradScaler"}[dtype]


def make_grad_scaler(dtype, device):
    """fp16 gradients underflow without loss scaling; bf16 and fp32 do not. Disabled, the
    scaler passes every call straight through (no scaling, no host sync). Enabled, its step()
    reads found_inf on the host: one sync per step, the price of fp16. On FSDP's DTensor
    gradients the inf check is reduced over the mesh, so every rank skips the same steps."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


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
# Llama-shaped sizes. debug is what every test and lesson trains (a CPU step in milliseconds).
# 1b has Llama-3.2-1B's shape but an untied output layer (1.50B parameters, not 1.24B); 8b has
# Llama-3.1-8B's dimensions (8.03B) and 70b Llama-3.1-70B's (70.55B, for --plan). Fields left
# as None follow from the others: num_kv_heads = num_heads (no grouped-query attention),
# ffn_dim = 4 x dim.
MODEL_PRESETS = {
    "debug": dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=None, ffn_dim=None,
                  vocab_size=64, seq_len=32, micro_batch_size=8, rope_theta=1e4),
    "small": dict(dim=256, num_layers=4, num_heads=8, num_kv_heads=4, ffn_dim=768,
                  vocab_size=256, seq_len=256, micro_batch_size=8, rope_theta=1e4),
    "1b": dict(dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, ffn_dim=8192,
               vocab_size=128256, seq_len=2048, micro_batch_size=4, rope_theta=5e5),
    "8b": dict(dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
               vocab_size=128256, seq_len=8192, micro_batch_size=1, rope_theta=5e5),
    "70b": dict(dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672,
                vocab_size=128256, seq_len=8192, micro_batch_size=1, rope_theta=5e5),
}


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
        # In fp32, as Meta's Llama does: in fp16 the backward of rsqrt at a small mean square
        # (embeddings of std 0.02) exceeds 65504 and the gradient becomes inf. A no-op in fp32.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(seq_len, head_dim, device, theta):
    """Rotary-embedding cos/sin, computed per call: no buffers, so DDP has none to broadcast."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)  # fp32 tables must not upcast bf16 q/k


class Attention(nn.Module):
    def __init__(self, dim, num_heads, num_kv_heads, rope_theta):
        super().__init__()
        self.head_dim, self.rope_theta = dim // num_heads, rope_theta
        kv_dim = num_kv_heads * self.head_dim  # grouped-query attention: fewer k/v heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_dim, bias=False)
        self.wv = nn.Linear(dim, kv_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        bsz, seq_len, _ = x.shape
        # -1 heads: tensor parallel shards wq/wk/wv by heads, and this still works unchanged.
        q, k, v = (w(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        cos, sin = rope_tables(seq_len, self.head_dim, x.device, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
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
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    """Llama-style decoder. Layers live in a ModuleDict keyed by index, so a pipeline stage can
    delete the others (and set tok_embeddings / norm / output to None) without renaming."""

    def __init__(self, cfg):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

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
    return TinyLlama(cfg)


def parameter_shapes(cfg):
    """{name: shape} of build_model(cfg), built on the meta device: no memory, any size."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in build_model(cfg).named_parameters()}
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


def micro_batches(cfg, rank, world_size, start_step, pin_memory=False):
    """Yield this rank's micro-batches forever, starting at optimizer step `start_step`.
    pin_memory (on CUDA): a non_blocking copy from pageable memory is synchronous anyway; from
    pinned memory it overlaps with compute."""
    dataset = build_dataset(cfg)
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=cfg.seed, drop_last=True)
    micro_batch = cfg.batch_size // (world_size * cfg.grad_accum)
    # Every iter(loader) draws a seed for its workers from `generator`; left out, it draws
    # from the global RNG, and a resumed run (fewer iter() calls) would continue on another
    # RNG stream than an uninterrupted one. Seeded per epoch below, so both draw the same.
    seeds = torch.Generator()
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True,
                        num_workers=cfg.num_workers, generator=seeds, pin_memory=pin_memory,
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
    mfu = metrics["mfu"]
    fields = [f"done | {metrics['lab']} | {metrics['backend']} x{metrics['world_size']}",
              f"{metrics['steps']} steps", f"loss {metrics['final_loss']:.4f}"]
    if "parity_max_abs_diff" in metrics:  # the full labs; their lean copies have no reference
        parity = metrics["parity_max_abs_diff"]
        fields.append(f"parity {'n/a' if parity is None else f'{parity:.1e}'}")
    fields += [f"{metrics['tokens_per_s']:.0f} tok/s",
               f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}", f"{metrics['wall_time_s']:.1f} s"]
    return " | ".join(fields)


# Dense bf16 tensor-core peaks (no sparsity), as in torchtitan's get_peak_flops
# (torchtitan/tools/utils.py), from NVIDIA's datasheets; fp16 for the GPUs without bf16.
# Memory is the nominal size on the box. Keys are what --plan --gpu takes; "match" finds the
# entry for torch.cuda.get_device_name() (first match wins, most specific first).
GPU_SPECS = {
    "B200-180GB": dict(match=("b200",), memory_gb=180, peak_flops=2.25e15, bf16=True),
    "H200-141GB": dict(match=("h200",), memory_gb=141, peak_flops=989e12, bf16=True),
    "H100-NVL-94GB": dict(match=("h100", "nvl"), memory_gb=94, peak_flops=835e12, bf16=True),
    "H100-PCIe-80GB": dict(match=("h100", "pcie"), memory_gb=80, peak_flops=756e12, bf16=True),
    "H100-80GB": dict(match=("h100",), memory_gb=80, peak_flops=989e12, bf16=True),
    "A100-80GB": dict(match=("a100", "80"), memory_gb=80, peak_flops=312e12, bf16=True),
    "A100-40GB": dict(match=("a100",), memory_gb=40, peak_flops=312e12, bf16=True),
    "L40S-48GB": dict(match=("l40s",), memory_gb=48, peak_flops=362e12, bf16=True),
    "L4-24GB": dict(match=("l4",), memory_gb=24, peak_flops=121e12, bf16=True),
    "V100-32GB": dict(match=("v100",), memory_gb=32, peak_flops=125e12, bf16=False),
    "T4-16GB": dict(match=("t4",), memory_gb=16, peak_flops=65e12, bf16=False),
}


def gpu_spec_for(device_name):
    """(key, spec) of GPU_SPECS for a device name, or (None, None): no guess for an unknown GPU."""
    name = device_name.lower()
    for key, spec in GPU_SPECS.items():
        if all(part in name for part in spec["match"]):
            return key, spec
    return None, None


def measure_matmul_peak(device, dtype, size=512, seconds=0.1, bursts=3):
    """FLOP/s of one square matmul on this process's threads: the CPU's stand-in for a
    datasheet peak. Run on every rank at once, as in training, so the ranks share the cores.
    The best of a few short bursts: a burst the scheduler interrupts reads low, which makes
    the MFU read high (one run with a single 0.1 s burst reported 205%); nothing reads high."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b  # warm-up: thread pool, caches
    best = 0.0
    for _ in range(bursts):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            calls += 1
        best = max(best, 2 * size ** 3 * calls / (time.perf_counter() - t0))
    return best


def device_peak_flops(device, dtype):
    """(peak FLOP/s per device, where the figure comes from)."""
    if device.type == "cuda":
        key, spec = gpu_spec_for(torch.cuda.get_device_name(device))
        if spec is None:
            return None, f"no GPU_SPECS entry for {torch.cuda.get_device_name(device)}"
        return spec["peak_flops"], f"{key} datasheet, {'bf16' if spec['bf16'] else 'fp16'} dense"
    # fp32 whatever the run's dtype: CPUs without bf16/fp16 matrix units emulate them, slower
    # than fp32, and a slow peak would flatter the MFU (it can pass 100%).
    measured = measure_matmul_peak(device, torch.float32)
    return measured, (f"measured here: fp32 512x512 matmul on {torch.get_num_threads()} "
                      f"thread(s) per rank")


def flops_per_token(cfg, seq_len):
    """Training FLOPs per token: 6 per matmul weight (2 forward, 4 backward; the embedding is
    a lookup and the norms' weights scale elementwise, so both are left out), plus attention's
    QK^T and AV, 12 x layers x heads x head_dim x seq_len (PaLM, arXiv:2204.02311, appendix B;
    causal masking is not subtracted, as in torchtitan). With the actual sequence length."""
    shapes = parameter_shapes(cfg)
    matmul_params = sum(math.prod(s) for n, s in shapes.items()
                        if len(s) == 2 and "embeddings" not in n)
    return 6 * matmul_params + 12 * cfg.num_layers * cfg.dim * seq_len


def utilisation(cfg, log, world_size, device, dtype):
    """Throughput, FLOPs per token, achieved FLOP/s per rank, the peak and MFU. Every rank
    calls it at once: on CPU each measures its matmul peak while the others do too."""
    tokens_per_s = log.steady_tokens_per_s(cfg.batch_size * cfg.seq_len)
    per_token = flops_per_token(cfg, cfg.seq_len)
    achieved = per_token * tokens_per_s / world_size
    peak, source = device_peak_flops(device, dtype)
    return {"tokens_per_s": tokens_per_s, "flops_per_token": per_token,
            "achieved_flops_per_rank": achieved, "peak_flops_per_rank": peak,
            "peak_source": source, "mfu": achieved / peak if peak else None}


def common_metrics(cfg, log, world_size, device, wall_start, usage):
    """The metrics JSON fields every lab writes (rank 0); each lab adds its own."""
    losses = log.losses
    return {
        "lab": LAB_NAME, "backend": dist.get_backend(), "device": device.type,
        "world_size": world_size, "steps": losses[-1][0] if losses else 0,
        "final_loss": losses[-1][1] if losses else float("nan"), "losses": losses,
        **usage, "step_windows": log.windows,
        "first_step_s": log.windows[0]["seconds"] if log.windows else None,
        "peak_mem_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss",
        "wall_time_s": time.perf_counter() - wall_start,
        "torch_version": torch.__version__, "config": vars(cfg),
    }


# lean: begin the parity report
def parity_metrics(cfg, parity, ref_losses):
    return {"reference_losses": ref_losses, "parity_max_abs_diff": parity,
            "parity_tol": cfg.parity_tol}


def exit_if_parity_fails(parity, tolerance, detail=""):
    if parity is not None and parity > tolerance:
        sys.exit(f"parity check failed: max |param diff| {parity:.2e} > {tolerance:.0e}{detail}")
# lean: end
# --8<-- [end:metrics]


# --8<-- [start:plan]
MEMORY_LEFT_OUT = (
    "the CUDA context and NCCL's buffers (about 0.5-1 GB per process)",
    "allocator fragmentation and cached-but-free blocks",
    "temporaries inside one op (attention workspace, the optimizer's foreach buffers)",
    "a checkpoint's staging copies while it is saved",
)
FIT_FRACTION = 0.9  # the estimate may fill 90% of a device; the rest is for MEMORY_LEFT_OUT


def device_capacity_bytes(device_type, num_local_ranks):
    """What one rank may use: its GPU's memory, or an even share of this machine's RAM."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // num_local_ranks


def activation_elements_per_token(cfg):
    """Elements one block saves for backward per token, counted from Block.forward with a fused
    (flash) attention that keeps no seq x seq scores: the norms' inputs and outputs, q/k/v
    before and after RoPE, the attention output, and SwiGLU's four hidden-width tensors."""
    kv_dim = cfg.num_kv_heads * (cfg.dim // cfg.num_heads)
    return 9 * cfg.dim + 3 * kv_dim + 4 * cfg.ffn_dim


def estimate_memory(cfg, layout, dtype):
    """Bytes the busiest rank needs, by item (AdamW, fp32 master weights and gradients).

    layout (from the lab's plan_layout): state_shards / optimizer_shards, the ranks that
    split each parameter's state; tp, the tensor-parallel degree; layers, the blocks a rank
    holds; in_flight, the micro-batches whose activations it holds at once; micro_batch, the
    sequences in each; fsdp, whether blocks are gathered whole; ddp_buckets, DDP's copy of
    the gradients."""
    shapes = parameter_shapes(cfg)
    block = sum(math.prod(s) for n, s in shapes.items() if n.startswith("layers.0."))
    outside = sum(math.prod(s) for n, s in shapes.items() if not n.startswith("layers."))
    held = layout["layers"] * block + outside
    compute_bytes = 4 if dtype is None else 2
    tokens = layout["micro_batch"] * cfg.seq_len
    per_block_act = activation_elements_per_token(cfg) * tokens * compute_bytes // layout["tp"]
    stored_blocks = 1 if getattr(cfg, "activation_checkpointing", False) else layout["layers"]
    checkpointed = (layout["layers"] - stored_blocks) * cfg.dim * tokens * compute_bytes
    items = {
        "params (fp32)": 4 * held // layout["state_shards"],
        "grads (fp32)": 4 * held // layout["state_shards"],
        "AdamW state (2 x fp32)": 8 * held // layout["optimizer_shards"],
        "DDP gradient buckets": 4 * held if layout["ddp_buckets"] else 0,
        # The block that computes and the one prefetched, unsharded, with their gradients.
        "gathered blocks (FSDP)": (2 * block * (compute_bytes + 4) // layout["tp"]
                                   if layout["fsdp"] else 0),
        "activations": layout["in_flight"] * (stored_blocks * per_block_act + checkpointed),
        # Logits in the compute dtype, their fp32 copy for the loss, and its gradient.
        "logits and loss": tokens * cfg.vocab_size * (compute_bytes + 8),
    }
    return {name: value for name, value in items.items() if value}


def check_fits(cfg, layout, dtype, capacity, label):
    """Refuse a run whose estimate cannot fit, before any process group: one line, exit 2."""
    items = estimate_memory(cfg, layout, dtype)
    need = sum(items.values())
    if need > FIT_FRACTION * capacity:
        biggest = max(items, key=items.get)
        fail_config("--model", f"{cfg.model} needs about {need / 1e9:.1f} GB per rank "
                    f"({biggest}: {items[biggest] / 1e9:.1f} GB), {label} has "
                    f"{capacity / 1e9:.1f} GB: see --plan, or choose a smaller --model")


def plan_target(cfg, world_size):
    """(label, capacity per rank, dtype, peak FLOP/s) of the hardware a plan is for."""
    if cfg.gpu:
        spec = GPU_SPECS[cfg.gpu]
        dtype = choose_precision(cfg.amp, "cuda", spec["bf16"])
        return (f"{world_size} x {cfg.gpu}", spec["memory_gb"] * 1e9, dtype, spec["peak_flops"])
    device_type = pick_device_type(cfg)
    if device_type == "cuda" and not torch.cuda.is_available():
        fail_config("--gpu", "no GPU on this machine to plan for: name one, e.g. --gpu H100-80GB")
    capacity = device_capacity_bytes(device_type, min(world_size, local_world_size()) or 1)
    return (f"{world_size} x this machine's {device_type}", capacity,
            compute_dtype(cfg, device_type), None)


def print_plan(cfg, layout, world_size):
    label, capacity, dtype, peak = plan_target(cfg, world_size)
    items = estimate_memory(cfg, layout, dtype)
    need, num_params = sum(items.values()), sum(math.prod(s) for s in parameter_shapes(cfg).values())
    fits = need <= FIT_FRACTION * capacity
    lines = [f"plan | {LAB_NAME} | {label} | --model {cfg.model}: {num_params / 1e9:.2f}B params, "
             f"seq {cfg.seq_len}, micro-batch {cfg.micro_batch_size}, global batch {cfg.batch_size}",
             f"mesh: {layout['mesh']} ({layout['what']})",
             f"precision: {precision_name(dtype)} compute; {layout['precision']}",
             f"FLOPs per token: {flops_per_token(cfg, cfg.seq_len) / 1e9:.1f} GFLOP"
             + (f"; peak {peak / 1e12:.0f} TFLOP/s per GPU" if peak else ""),
             "memory per rank (estimate, the busiest rank):"]
    lines += [f"  {name:28s} {value / 1e9:8.2f} GB" for name, value in items.items()]
    lines += [f"  {'total':28s} {need / 1e9:8.2f} GB of {capacity / 1e9:.1f} GB: "
              f"{'fits' if fits else 'does NOT fit'} (limit {FIT_FRACTION:.0%})",
              "not counted: " + "; ".join(MEMORY_LEFT_OUT)]
    if not fits and getattr(cfg, "activation_checkpointing", True) is False:
        recompute = argparse.Namespace(**{**vars(cfg), "activation_checkpointing": True})
        total = sum(estimate_memory(recompute, layout, dtype).values())
        lines.append(f"with --activation-checkpointing: {total / 1e9:.2f} GB, "
                     f"{'fits' if total <= FIT_FRACTION * capacity else 'still does NOT fit'}")
    print("\n".join(lines))
    return fits


def plan_or_refuse(cfg, layout, world_size):
    """--plan: print the plan, exit 0. Otherwise refuse a run whose estimate cannot fit."""
    if cfg.plan:
        print_plan(cfg, layout, world_size)
        sys.exit(0)
    device_type = pick_device_type(cfg)
    capacity = device_capacity_bytes(device_type, local_world_size())
    check_fits(cfg, layout, compute_dtype(cfg, device_type), capacity,
               f"this machine's {device_type}")
# --8<-- [end:plan]


# --8<-- [start:faults]
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "stopped on request, checkpoint written, rerun me"


# lean: begin fault injection (the drills of tests/test_fault_tolerance*.py)
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
# lean: end


class PreemptionWatch:
    """SIGTERM (a scheduler preempting the job) only raises a flag; the loop goes on to its next
    sync point (StepLog.add), where all ranks agree in one all-reduce, so they checkpoint and
    stop together."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.requested = True
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


# --8<-- [start:loop]
class StepLog:
    """Losses, step times and the preemption flag, read from the device at sync points only.

    CUDA runs ahead of Python, and anything that reads a device value on the host
    (loss.item(), the result of a flag's all-reduce, torch.cuda.synchronize) makes Python
    wait until the GPU has caught up, and the launch queue runs dry. So each step's loss
    stays on the device. At a sync point (the first step, whose time includes warm-up; every
    --log-every steps; each checkpoint step; the last step) one all-reduce carries every
    pending loss and the preemption flag, and one read brings them to the host. That read
    returns only when the device has finished the window's work, so a window's time is honest
    on CUDA without a synchronize per step."""

    def __init__(self, cfg, device, start_step, last_step, loss_divisor):
        self.cfg, self.device, self.first, self.last = cfg, device, start_step + 1, last_step
        self.loss_divisor = loss_divisor  # the all-reduce sums; this turns it into the mean
        self.pending, self.losses, self.windows = [], [], []
        self.data_s, self.window_start = 0.0, time.perf_counter()

    def is_sync_point(self, step):
        every = self.cfg.checkpoint_every if self.cfg.checkpoint_dir else 0
        return (step in (self.first, self.last) or step % self.cfg.log_every == 0
                or bool(every and step % every == 0))

    def add(self, step, loss, data_s, preemption):
        """Record one step. At a sync point, returns whether any rank was asked to stop."""
        self.pending.append(loss.detach().float().reshape(1))
        self.data_s += data_s
        if not self.is_sync_point(step):
            return False
        flag = torch.tensor([float(preemption.requested)], device=self.device)
        packed = torch.cat([*self.pending, flag])
        dist.all_reduce(packed)  # SUM: every rank's losses, and how many ranks must stop
        *sums, stops = packed.tolist()  # the window's one host read
        seconds = time.perf_counter() - self.window_start
        first = step - len(sums) + 1
        self.losses += [[first + i, total / self.loss_divisor] for i, total in enumerate(sums)]
        self.windows.append({"last_step": step, "steps": len(sums), "seconds": seconds,
                             "data_s": self.data_s})
        self.pending, self.data_s, self.window_start = [], 0.0, time.perf_counter()
        return stops > 0

    def restart_window(self):
        """After a checkpoint: its time is not training time. Called at a sync point, so no
        device work is pending."""
        self.window_start = time.perf_counter()

    def log(self, tokens_per_step):
        window = self.windows[-1]
        step_s = window["seconds"] / window["steps"]
        return log_line(window["last_step"], self.losses[-1][1], step_s,
                        tokens_per_step / step_s, window["data_s"] / window["seconds"],
                        peak_memory_bytes(self.device))

    def steady_tokens_per_s(self, tokens_per_step):
        """Throughput after the first step (compile, allocator warm-up, lazy init)."""
        steady = self.windows[1:] or self.windows
        return tokens_per_step * sum(w["steps"] for w in steady) / sum(w["seconds"] for w in steady)

    def data_share(self):
        return sum(w["data_s"] for w in self.windows) / max(sum(w["seconds"] for w in self.windows), 1e-9)


def train_loop(cfg, rank, device, start_step, log, step_fn, save_fn):
    """Steps start_step+1 .. the last: step_fn(step) -> (loss, data seconds); save_fn(step)
    writes a checkpoint. Logs, checkpoints and preemption happen at StepLog's sync points."""
    last_step = cfg.stop_at_step or cfg.steps
    tokens_per_step = cfg.batch_size * cfg.seq_len
    preemption = PreemptionWatch()
    for step in range(start_step + 1, last_step + 1):
        maybe_inject_failure(cfg, step, rank)  # lean: drop
        maybe_stall(cfg, step, rank, preemption)  # lean: drop
        loss, data_s = step_fn(step)
        preempted = log.add(step, loss, data_s, preemption)
        if rank == 0 and (step % cfg.log_every == 0 or step == last_step):  # sync points
            print(log.log(tokens_per_step), flush=True)
        if cfg.checkpoint_dir and ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                                   or step == last_step or preempted):
            save_fn(step)
            log.restart_window()
        if preempted:
            if rank == 0:
                print(f"preempted: checkpoint at step {step} written, exiting "
                      f"{PREEMPTED_EXIT_CODE}", flush=True)
            teardown_distributed()
            sys.exit(PREEMPTED_EXIT_CODE)
# --8<-- [end:loop]


# The point of the lab: shard with fully_shard, measure what each rank holds, checkpoint with DCP.
# --- context parallelism: the sequence split and ring attention -----------------------------
def num_chunks(cp_size, layout):
    return cp_size if layout == "contiguous" else 2 * cp_size


def chunk_ids(cp_rank, cp_size, layout):
    """The chunks of each sequence that a cp rank holds, in the order they sit in its tensors."""
    return [cp_rank] if layout == "contiguous" else [cp_rank, 2 * cp_size - 1 - cp_rank]


def shard_sequence(full, cp_rank, cp_size, layout, seq_dim=1):
    """This rank's tokens of a [batch, seq, ...] tensor."""
    chunks = full.chunk(num_chunks(cp_size, layout), dim=seq_dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp_rank, cp_size, layout)], dim=seq_dim)


def sequence_positions(seq_len, cp_rank, cp_size, layout, device):
    """The global positions of this rank's tokens: what RoPE must rotate by."""
    return shard_sequence(torch.arange(seq_len, device=device), cp_rank, cp_size, layout, 0)


def visible(q_chunk, k_chunk):
    """Causal attention of a query chunk to a key chunk: "all", "diagonal", or None (skip)."""
    return "all" if k_chunk < q_chunk else "diagonal" if k_chunk == q_chunk else None


def causal_scores(q, k, scale, diagonal):
    scores = (q @ k.transpose(-2, -1)) * scale
    if diagonal:  # the same chunk: query i sees keys 0..i
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def merge(out, lse, block_out, block_lse):
    """Attention over two disjoint key sets from their parts: each normalised output is
    re-weighted by exp(its lse - the union's lse). Exact, and no exp can overflow."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new_lse).unsqueeze(-1)
            + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)), new_lse


def rotate(tensor, group):
    """The ring's step: send to the next cp rank, receive from the previous one. Both are
    posted together, so no pair of ranks waits on the other; P2POp takes global ranks."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    if cp_size == 1:
        return tensor
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(),
                      dist.get_global_rank(group, (cp_rank + 1) % cp_size), group),
           dist.P2POp(dist.irecv, received,
                      dist.get_global_rank(group, (cp_rank - 1) % cp_size), group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def ring_forward(q, k, v, group, layout):
    """Causal attention of this rank's queries to the whole sequence: cp steps of compute,
    cp - 1 rotations of the key/value slice. Returns (out, lse)."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    scale = 1.0 / math.sqrt(q.shape[-1])
    my_ids = chunk_ids(cp_rank, cp_size, layout)
    q_chunks = q.chunk(len(my_ids), dim=-2)
    outs, lses = [None] * len(my_ids), [None] * len(my_ids)
    kv = torch.stack([k, v])
    for step in range(cp_size):
        kv_ids = chunk_ids((cp_rank - step) % cp_size, cp_size, layout)
        k_chunks, v_chunks = (t.chunk(len(kv_ids), dim=-2) for t in kv)
        for qi, q_id in enumerate(my_ids):
            for ki, k_id in enumerate(kv_ids):
                seen = visible(q_id, k_id)
                if seen is None:
                    continue  # wholly in the future
                scores = causal_scores(q_chunks[qi], k_chunks[ki], scale, seen == "diagonal")
                lse = torch.logsumexp(scores, dim=-1)
                block = torch.exp(scores - lse.unsqueeze(-1)) @ v_chunks[ki]
                outs[qi], lses[qi] = merge(outs[qi], lses[qi], block, lse)
        if step < cp_size - 1:
            kv = rotate(kv, group)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def ring_backward(q, k, v, out, lse, dout, group, layout):
    """dq, dk, dv. With the final lse each block's probabilities are its exact share of the
    softmax, so blocks are independent; the key/value slice travels with its gradient
    accumulator, and after cp rotations both are back home."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    scale = 1.0 / math.sqrt(q.shape[-1])
    my_ids = chunk_ids(cp_rank, cp_size, layout)
    delta = (dout * out).sum(-1)  # rowsum(dout * out): the softmax backward's correction
    dq = torch.zeros_like(q)
    q_c, dout_c, dq_c = (t.chunk(len(my_ids), dim=-2) for t in (q, dout, dq))
    lse_c, delta_c = (t.chunk(len(my_ids), dim=-1) for t in (lse, delta))
    kv_grad = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
    for step in range(cp_size):
        kv_ids = chunk_ids((cp_rank - step) % cp_size, cp_size, layout)
        k_c, v_c, dk_c, dv_c = (t.chunk(len(kv_ids), dim=-2) for t in kv_grad)
        for qi, q_id in enumerate(my_ids):
            for ki, k_id in enumerate(kv_ids):
                seen = visible(q_id, k_id)
                if seen is None:
                    continue
                scores = causal_scores(q_c[qi], k_c[ki], scale, seen == "diagonal")
                probs = torch.exp(scores - lse_c[qi].unsqueeze(-1))
                dv_c[ki].add_(probs.transpose(-2, -1) @ dout_c[qi])  # views: += writes through
                dscores = probs * (dout_c[qi] @ v_c[ki].transpose(-2, -1)
                                   - delta_c[qi].unsqueeze(-1))
                dq_c[qi].add_((dscores @ k_c[ki]) * scale)
                dk_c[ki].add_((dscores.transpose(-2, -1) @ q_c[qi]) * scale)
        kv_grad = rotate(kv_grad, group)
    return dq, kv_grad[2], kv_grad[3]


class RingAttention(torch.autograd.Function):
    """Causal ring attention over the cp group, in fp32 whatever autocast says: it saves only
    this rank's q, k, v, output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout):
        with torch.autocast(q.device.type, enabled=False):
            out, lse = ring_forward(q, k, v, group, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout = group, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = ring_backward(q, k, v, out, lse, dout.float().contiguous(), ctx.group,
                                       ctx.layout)
        return dq, dk, dv, None, None


class ContextParallelAttention(Attention):
    """The model's Attention, on this rank's tokens only: RoPE at their global positions, and
    the ring in place of scaled_dot_product_attention. Same parameters, same names."""

    def forward(self, x):
        bsz, local_len, _ = x.shape
        q, k, v = (w(x).view(bsz, local_len, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        seq_len = local_len * self.cp_size
        cos, sin = rope_tables(seq_len, self.head_dim, x.device, self.rope_theta)
        positions = sequence_positions(seq_len, self.cp_rank, self.cp_size, self.layout,
                                       x.device)
        q = apply_rope(q, cos[positions], sin[positions])
        k = apply_rope(k, cos[positions], sin[positions])
        if k.shape[1] != q.shape[1]:  # grouped-query attention: as SDPA's enable_gqa
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out = RingAttention.apply(q.float(), k.float(), v.float(), self.cp_group, self.layout)
        return self.wo(out.type_as(q).transpose(1, 2).reshape(bsz, local_len, -1))


def apply_context_parallel(model, cp_mesh, cfg):
    """Swap every block's attention for the ring version (in place: no new parameters, so
    fully_shard, checkpoints and the one-process reference see the same names)."""
    for block in model.layers.values():
        block.attention.__class__ = ContextParallelAttention
        block.attention.cp_group = cp_mesh.get_group()
        block.attention.cp_rank, block.attention.cp_size = cp_mesh.get_local_rank(), cp_mesh.size()
        block.attention.layout = cfg.layout


def shard_batches(batches, cp_mesh, layout):
    """Each micro-batch's inputs and targets, cut to this rank's tokens."""
    cp_rank, cp_size = cp_mesh.get_local_rank(), cp_mesh.size()
    for inputs, targets in batches:
        yield (shard_sequence(inputs, cp_rank, cp_size, layout),
               shard_sequence(targets, cp_rank, cp_size, layout))


def build_mesh(cfg, device, world_size):
    """Two meshes over the same ranks. ("dp", "cp"), cp inner: a cp group is cp consecutive
    ranks (one node, on GPUs), the ring's fast links. ("dp_cp",): all ranks, for fully_shard,
    which then averages each gradient over every token of the global batch."""
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    layout_mesh = init_mesh(device.type, (world_size // cfg.cp, cfg.cp), ("dp", "cp"), timeout)
    fsdp_mesh = init_mesh(device.type, (world_size,), ("dp_cp",), timeout)
    return layout_mesh, fsdp_mesh


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
    param_dtype = fsdp_param_dtype(cfg, device.type)
    if param_dtype is not None:
        # Params are all-gathered and used in bf16 (or fp16); grads are reduced in fp32 so the
        # average over ranks does not lose bits. The sharded fp32 params stay the optimizer's
        # master copy.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
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


def build_fsdp_model(cfg, layout_mesh, mesh, device):
    with torch.device("meta"):  # shapes only: no rank allocates the full model
        model = build_model(cfg)
    apply_context_parallel(model, layout_mesh["cp"], cfg)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.compile:
        apply_compile(model, cfg.compile_backend)
    apply_fsdp(model, mesh, cfg, device)
    # Allocate only the local shards, then fill them.
    model.to_empty(device="cpu" if cfg.cpu_offload else device)
    init_sharded_weights(model, cfg.seed)
    return model


def build_optimizer(cfg, model):
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr)


# lean: begin inspection and byte probes
def inspect_fsdp(model, mesh, cfg):
    """What each rank holds after fully_shard: every parameter a DTensor on the mesh of all
    ranks, Shard(0), local rows as chunked by torch.chunk. Returns {name: [placements, global shape, local shapes per rank]}."""
    expected = (Shard(0),)
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
    states = [v for state in optimizer.state.values() for v in state.values()
              if torch.is_tensor(v)]
    return {"params": held_bytes(p for p in model.parameters()),
            "grads": held_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": held_bytes(states)}


def unsharded_param_bytes(model):
    """Bytes of parameters registered in full form right now. Between forward and backward
    this is what reshard_after_forward decides: the root only (true) or every block (false)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if not isinstance(p, DTensor))
# lean: end


@contextlib.contextmanager
def gradient_sync(model, enabled):
    """Accumulation micro-steps skip communication: FSDP keeps unsharded grads and skips the
    reduce-scatter (more memory until the last micro-step)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    yield


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train_step(model, optimizer, scaler, batches, cfg, device, amp_dtype, probe=None):
    """One optimizer step of grad_accum micro-steps. Returns (loss on the device, data-wait
    seconds). probe (a dict) receives the measurements that only exist mid-step."""
    data_s, total_loss = 0.0, 0.0
    for micro in range(cfg.grad_accum):
        t0 = time.perf_counter()
        inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        data_s += time.perf_counter() - t0
        with gradient_sync(model, micro == cfg.grad_accum - 1):
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(inputs)
            if probe is not None and micro == 0:  # lean: drop
                probe["unsharded_after_forward"] = unsharded_param_bytes(model)  # lean: drop
            loss = loss_fn(logits, targets) / cfg.grad_accum
            scaler.scale(loss).backward()
        total_loss += loss.detach()
    if cfg.clip:
        scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
        # On DTensor grads this computes the norm of the local shards and all-reduces it, so
        # every rank clips by the global norm.
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    scaler.step(optimizer)  # skips the step if fp16 gradients overflowed (on any rank)
    scaler.update()
    if probe is not None:  # lean: drop
        probe.update(measure_state_bytes(model, optimizer))  # lean: drop
    optimizer.zero_grad(set_to_none=True)
    return total_loss, data_s


# --8<-- [start:checkpoint]
def checkpoint_path(directory, step):
    return Path(directory) / f"step_{step:08d}"


def complete_checkpoints(directory):
    """step_* directories (never *.tmp) that hold DCP's .metadata, oldest first. The
    coordinator writes .metadata last, and a directory loses its .tmp only once complete."""
    return sorted(p for p in Path(directory).glob("step_*") if p.suffix != ".tmp"
                  and (p / ".metadata").exists()) if directory else []


def latest_checkpoint(directory):
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint_atomically(cfg, state, step, rank):
    """Every rank writes its shards of `state` into step_N.tmp; rank 0 renames it to step_N
    only after all ranks finished, so a crash mid-save leaves a .tmp that resume never looks
    at. Keeps the newest two checkpoints."""
    final = checkpoint_path(cfg.checkpoint_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
        final.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()  # nobody writes into tmp while rank 0 may still be clearing it
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()  # every rank's files, and rank 0's .metadata, are on disk (fsynced by DCP)
    if rank == 0:
        maybe_crash_mid_checkpoint(cfg, step)  # lean: drop
        shutil.rmtree(final, ignore_errors=True)  # a rerun that saves the same step again
        record_batch_size(cfg)
        os.replace(tmp, final)  # atomic rename of the whole directory
        fd = os.open(final.parent, os.O_RDONLY)
        os.fsync(fd)  # make the rename itself durable
        os.close(fd)
        for old in complete_checkpoints(final.parent)[:-2]:
            shutil.rmtree(old)
    dist.barrier()  # nobody races ahead (or reads) while rank 0 is renaming
# --8<-- [end:checkpoint]


def checkpoint_state(cfg, model, optimizer, step, rank):
    # Sharded state dicts: each rank contributes its DTensor shards; DCP records the global
    # layout, so a different world size can load them (it reads only the slices it needs).
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "step": step,
            "data": {"samples_seen": step * cfg.batch_size}, f"rng_rank{rank}": torch.get_rng_state()}


def save_checkpoint(cfg, model, optimizer, step, rank):
    save_checkpoint_atomically(cfg, checkpoint_state(cfg, model, optimizer, step, rank), step, rank)


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


# lean: begin the single-process parity reference
def train_reference(cfg, dp_size, device):
    """The single-process run the sharded one must match: same init, plain attention over
    whole sequences, and each step accumulates every data-parallel rank's micro-batches in
    one process (the mean gradient of the global batch), with no communication at all."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg).to(device)
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
    losses = []
    for step in range(1, cfg.steps + 1):
        set_learning_rate([optimizer], cfg, step)
        fp32 = make_grad_scaler(None, device)  # disabled: the reference runs in fp32
        losses.append(train_step(model, optimizer, fp32, batches, accumulate_all, device,
                                 None)[0].item())
    return model, losses


def check_parity(cfg, full_state, world_size, device):
    reference, ref_losses = train_reference(cfg, world_size // cfg.cp, device)
    max_diff = max((full_state[name].to(device) - param).abs().max().item()
                   for name, param in reference.named_parameters())
    return max_diff, ref_losses
# lean: end


def build(cfg, world_size, device):
    """Model, optimizer, and the two meshes (layout, FSDP)."""
    layout_mesh, mesh = build_mesh(cfg, device, world_size)
    model = build_fsdp_model(cfg, layout_mesh, mesh, device)
    return model, build_optimizer(cfg, model), layout_mesh, mesh


def train(cfg, rank, world_size, device):
    torch.manual_seed(cfg.seed)
    model, optimizer, layout_mesh, mesh = build(cfg, world_size, device)
    layout = inspect_fsdp(model, mesh, cfg)  # lean: drop
    start_step = load_checkpoint(cfg, model, optimizer, rank) if cfg.checkpoint_dir else 0
    # --amp is autocast (as in lab01); --mixed-precision is FSDP's own policy, which is what
    # halves the all-gathers. With bf16 params autocast adds little: the matmuls already run
    # in bf16.
    amp_dtype = compute_dtype(cfg, device.type)
    param_dtype = fsdp_param_dtype(cfg, device.type)
    scaler = make_grad_scaler(torch.float16 if torch.float16 in (amp_dtype, param_dtype)
                              else None, device)
    # Each data-parallel rank reads its own sequences; the ranks of a cp group read the same
    # ones and keep their own chunks of them.
    dp_rank, dp_size = layout_mesh.get_local_rank("dp"), layout_mesh.size(0)
    batches = shard_batches(micro_batches(cfg, dp_rank, dp_size, start_step,
                                          pin_memory=device.type == "cuda"),
                            layout_mesh["cp"], cfg.layout)
    last_step = cfg.stop_at_step or cfg.steps
    log = StepLog(cfg, device, start_step, last_step, loss_divisor=world_size)
    probe = {}  # lean: drop
    if rank == 0:
        num_params = sum(p.numel() for p in model.parameters())
        print(f"{LAB_NAME} | {dist.get_backend()} x{world_size} | {device} | "
              f"mesh {dict(zip(layout_mesh.mesh_dim_names, layout_mesh.shape))}, "
              f"{cfg.layout} split | "
              f"autocast {precision_name(amp_dtype)}, FSDP params {precision_name(param_dtype)} | "
              f"{num_params:,} params | steps {start_step + 1}..{last_step}", flush=True)

    def step_fn(step):
        set_learning_rate([optimizer], cfg, step)
        # lean: begin the byte probes of the first step
        if step == start_step + 1:
            return train_step(model, optimizer, scaler, batches, cfg, device, amp_dtype, probe)
        # lean: end
        return train_step(model, optimizer, scaler, batches, cfg, device, amp_dtype)

    train_loop(cfg, rank, device, start_step, log, step_fn,
               lambda step: save_checkpoint(cfg, model, optimizer, step, rank))
    report = {"mesh": layout_mesh, "log": log, "precision": {"autocast": precision_name(amp_dtype),
                                                      "fsdp_params": precision_name(param_dtype)}}
    report.update(probe=probe, layout=layout)  # lean: drop
    return model, log, report


def gather_report(model, report, world_size, device):
    """Per-rank measurements, gathered to every rank (rank 0 writes them)."""
    mine = {"peak": peak_memory_bytes(device), "data_share": report["log"].data_share()}
    mine.update(report["probe"])  # lean: drop
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    per_rank = {k: [r.get(k) for r in everyone] for k in mine}
    mesh = report["mesh"]
    result = {
        "peak_mem_bytes_per_rank": per_rank["peak"], "data_share_per_rank": per_rank["data_share"],
        "num_params": sum(p.numel() for p in model.parameters()),
        "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh else None,
    }
    result.update(probe_report(model, report, per_rank))  # lean: drop
    return result


# lean: begin the byte probes' report
def probe_report(model, report, per_rank):
    return {
        "state_bytes_per_rank": {k: per_rank.get(k) for k in ("params", "grads", "optimizer")},
        "unsharded_param_bytes_after_forward": per_rank.get("unsharded_after_forward"),
        "param_shapes": {n: list(p.shape) for n, p in model.named_parameters()},
        "layout": report["layout"],
    }
# lean: end


def run(cfg, rank, world_size, device, wall_start):
    """Train, check parity, report. Every model lives and dies in here."""
    model, log, report = train(cfg, rank, world_size, device)
    extra = gather_report(model, report, world_size, device)
    amp_dtype = compute_dtype(cfg, device.type)
    usage = utilisation(cfg, log, world_size, device, amp_dtype)  # every rank at once
    needs_full = bool(cfg.export)
    needs_full = needs_full or cfg.check_parity  # lean: drop
    full_state = full_state_dict(model) if needs_full else None  # a collective: all ranks
    # lean: begin the parity reference
    parity, ref_losses = None, None
    if cfg.check_parity and rank == 0:
        parity, ref_losses = check_parity(cfg, full_state, world_size, device)
    # lean: end
    if cfg.export and rank == 0:
        export_consolidated(full_state, cfg.export)
    dist.barrier()  # the other ranks wait (within --timeout-s) for rank 0
    if rank == 0:
        metrics = {**common_metrics(cfg, log, world_size, device, wall_start, usage),
                   "cp": cfg.cp, "cp_layout": cfg.layout, "precision": report["precision"], **extra}
        metrics.update(parity_metrics(cfg, parity, ref_losses))  # lean: drop
        if cfg.metrics_out:
            write_json_atomic(cfg.metrics_out, metrics)
        print(summary_line(metrics), flush=True)
        exit_if_parity_fails(parity, cfg.parity_tol)  # lean: drop


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
