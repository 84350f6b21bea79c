"""Lab 08: expert parallelism (a top-k mixture of experts) composed with FSDP2.

What it teaches: each block's SwiGLU MLP becomes a mixture of --num-experts SwiGLU experts and
a router that sends every token to its --top-k experts. The experts are stacked parameters
[num_experts, ...], DTensors sharded Shard(0) over the "ep" axis: an ep rank computes only
num_experts/ep of them. Tokens travel to their experts' ranks and back with two uneven
all_to_all_single calls (dispatch, combine), after the per-expert counts are exchanged. On top
of that, fully_shard shards the experts over "dp" and every other parameter over all ranks,
and both average their gradients over every token of the global batch. --capacity-factor
caps the tokens an expert takes from each rank's micro-batch (0: no cap, nothing dropped).
`--check-parity` retrains the same global batches in one process, every expert local, and
compares every parameter (fp32 on CPU: max |diff| must be <= 1e-5).

Launch (the same file everywhere; the backend follows the hardware):
    python labs/lab08_expert_parallel.py                                      # 1 process, ep 1
    torchrun --nproc-per-node 2 labs/lab08_expert_parallel.py --check-parity      # ep 2
    torchrun --nproc-per-node 4 labs/lab08_expert_parallel.py --ep 2 --check-parity   # dp 2 x ep 2
    torchrun --nproc-per-node 4 labs/lab08_expert_parallel.py --capacity-factor 1.0  # drops tokens
    python labs/lab08_expert_parallel.py --plan --model 8b --nproc 8 --gpu H100-80GB
    # two nodes (run on each; same --rdzv-id everywhere, node 0's address as the endpoint;
    # --checkpoint-dir must be on a filesystem both nodes share; keep an ep group in a node):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29400 --rdzv-id $JOB_ID labs/lab08_expert_parallel.py --ep 8

Minimum world size: 1 (ep 1 is FSDP with a mixture of experts). Expected last line of the
--check-parity run at 2 ranks (numbers vary slightly with hardware; the default global batch
is 8 sequences per rank, so the loss depends on the world size unless --batch-size is given):
    done | lab08_expert_parallel | gloo x2 | 40 steps | loss 0.35... | parity 3.7e-07 | ...
Measured on torch 2.13, 2 CPU cores: the default run at 2 ranks trains in 5-8 s (12-21 s
with torchrun's start-up); the gradient norms match the reference's to ~1e-6 (relative).
The experts run one matmul per local expert; on GPUs torchtitan runs them as one grouped GEMM
(torch._grouped_mm). The loss is cross-entropy + --aux-weight x the load-balancing loss.
--plan counts one expert's MLP per block (the dense model's shape), not all of them.
Lesson: lessons/08_expert_parallel.py. Runbooks: runbooks/ (hangs, OOM).

Use it in your project:
  - Replace: `build_model()` (run on the meta device by `build_fsdp_model()`); the MLP that
    `build_moe_model()` swaps for `MoEFeedForward`; `SyntheticSequences`; `loss_fn()`.
  - Keep: `dispatch_and_combine()` (counts first, then two uneven all-to-alls, both
    differentiable); `apply_expert_parallel()` (experts as Shard(0) DTensors on "ep": whole-
    model names in checkpoints); `clip_grad_norm()` (one norm over several meshes); DCP
    `save_checkpoint()` / `load_checkpoint()` (tmp dir, then rename; any world size or --ep).
  - Pitfalls: every rank of an ep group must run every all-to-all of every block
    (`dispatch_and_combine()`), even with no token for anyone, or its peers wait until
    --timeout-s (runbooks/collective-timeout.md). Expert gradients reach an ep rank from its
    whole group: at FSDP's default divide factor (dp) they are ep times too large
    (`apply_fsdp()` sets dp x ep; the parity check's gradient norms see it). A router that
    favours one expert makes its rank the straggler and the memory peak: watch "expert_load",
    raise --aux-weight or set --capacity-factor (runbooks/oom-mitigations.md).
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
# The differentiable all-to-all (torch.distributed.nn.functional's is deprecated in torch 2.13
# and points here). The module name has an underscore, but it is what torch's own DTensor and
# torchtitan's expert-parallel code call; lessons/moe_workers.py uses the same.
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

LAB_NAME = "lab08_expert_parallel"


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
    arg("--ep", type=int, default=0,
        help="expert-parallel degree: ranks that split each block's experts (0: all ranks); "
             "the rest of the world is data parallel for the experts")
    arg("--num-experts", type=int, default=8,
        help="experts per block (8: one per rank up to 8 ranks, the --ep default)")
    arg("--top-k", type=int, default=2, help="experts each token is routed to")
    arg("--capacity-factor", type=float, default=0.0,
        help="an expert takes at most ceil(factor x tokens x top-k / experts) routing choices "
             "from each rank's micro-batch, the earliest tokens first; the rest are dropped "
             "(their share of the MLP is 0). 0: no cap, no token dropped")
    arg("--aux-weight", type=float, default=0.01,
        help="weight of the load-balancing loss (Switch Transformer's alpha; 0: off)")
    arg("--reshard-after-forward", choices=["true", "false"], default="true",
        help="false keeps each block's gathered params from forward to backward (ZeRO-2-like)")
    arg("--mixed-precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
        help="FSDP's MixedPrecisionPolicy: params gathered and used in this dtype, grads "
             "reduced in fp32; auto = the --amp choice (bf16 on a GPU that has it, fp32 on cpu)")
    arg("--activation-checkpointing", action="store_true",
        help="recompute each block's activations in backward instead of storing them")
    arg("--export", default="",
        help="write one consolidated state dict file here at the end (loads in one process)")
    cfg = parser.parse_args(argv)
    world_size = planned_world_size(cfg)
    cfg.ep = cfg.ep or world_size
    validate_layout(cfg, world_size)  # before the batch defaults
    # Every rank reads its own sequences: the ep ranks are data parallel for everything but
    # the experts, so the batch splits over the whole world.
    validate_common(cfg, world_size, dp_size=world_size)
    plan_or_refuse(cfg, plan_layout(cfg, world_size), world_size)
    return cfg


def plan_layout(cfg, world_size):
    """What each rank holds, for estimate_memory() and --plan. The estimate follows the dense
    model's shapes (one MLP per block); with E experts a block's MLP is E/ep times larger."""
    return {"mesh": f"dp={world_size // cfg.ep}, ep={cfg.ep}; dense params fully_shard over all "
                    f"{world_size} ranks, experts over dp",
            "what": f"{cfg.num_experts} experts, top-{cfg.top_k}, all-to-all over ep; "
                    "fully_shard, one unit per block",
            "precision": "MixedPrecisionPolicy: params gathered in the compute dtype, grads "
                         "reduced in fp32, fp32 master shards",
            "state_shards": world_size, "optimizer_shards": world_size,
            "tp": 1, "layers": cfg.num_layers, "in_flight": 1,
            "micro_batch": cfg.batch_size // (world_size * cfg.grad_accum),
            "fsdp": True, "ddp_buckets": False}


def fsdp_param_dtype(cfg, device_type):
    """The dtype FSDP gathers params in (None: fp32). auto follows --amp: on CUDA that is bf16,
    and it matters, because autocast over fp32 shards still all-gathers fp32 (twice the bytes)."""
    if cfg.mixed_precision == "auto":
        return compute_dtype(cfg, device_type)
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.mixed_precision]


def validate_layout(cfg, world_size):
    """The ep degree and the experts, checked before any process group."""
    if cfg.ep < 0 or world_size % cfg.ep:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        fail_config("--ep", f"{cfg.ep} must divide the world size {world_size}; "
                    f"allowed: 0 (all ranks) or {', '.join(map(str, divisors))}")
    if cfg.num_experts <= 0 or cfg.num_experts % cfg.ep:
        fail_config("--num-experts", f"{cfg.num_experts} must be a positive multiple of "
                    f"--ep {cfg.ep}: each ep rank holds the same number of experts")
    if not 1 <= cfg.top_k <= cfg.num_experts:
        fail_config("--top-k", f"{cfg.top_k} must be between 1 and --num-experts "
                    f"{cfg.num_experts}")
    for name in ["capacity_factor", "aux_weight"]:
        if getattr(cfg, name) < 0:
            fail_config(f"--{name.replace('_', '-')}", f"must be >= 0, got {getattr(cfg, name)}")
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
# entry for torch.cuda.get_device_name(): every token in the name's tokens, none of "unless"
# (first match wins, most specific first).
GPU_SPECS = {
    "B200-180GB": dict(match=("b200",), memory_gb=180, peak_flops=2.25e15, bf16=True),
    "H200-141GB": dict(match=("h200",), unless=("nvl",), memory_gb=141, peak_flops=989e12,
                       bf16=True),
    "H100-NVL-94GB": dict(match=("h100", "nvl"), memory_gb=94, peak_flops=835e12, bf16=True),
    "H100-PCIe-80GB": dict(match=("h100", "pcie"), memory_gb=80, peak_flops=756e12, bf16=True),
    "H100-80GB": dict(match=("h100",), memory_gb=80, peak_flops=989e12, bf16=True),
    "A100-80GB": dict(match=("a100", "80gb"), memory_gb=80, peak_flops=312e12, bf16=True),
    "A100-40GB": dict(match=("a100",), memory_gb=40, peak_flops=312e12, bf16=True),
    "L40S-48GB": dict(match=("l40s",), memory_gb=48, peak_flops=362e12, bf16=True),
    "L4-24GB": dict(match=("l4",), memory_gb=24, peak_flops=121e12, bf16=True),
    "V100-32GB": dict(match=("v100", "32gb"), memory_gb=32, peak_flops=125e12, bf16=False),
    "T4-16GB": dict(match=("t4",), memory_gb=16, peak_flops=65e12, bf16=False),
}


def gpu_spec_for(device_name):
    """(key, spec) of GPU_SPECS for a device name, or (None, None): no guess for an unknown GPU.
    Whole tokens of the name, not substrings: "NVIDIA L40" is not an L4, "GH200" not an H200."""
    tokens = set("".join(c if c.isalnum() else " " for c in device_name.lower()).split())
    for key, spec in GPU_SPECS.items():
        if set(spec["match"]) <= tokens and not set(spec.get("unless", ())) & tokens:
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


# The point of the lab: route tokens to experts on other ranks, shard with fully_shard,
# checkpoint with DCP.
# --- the mixture of experts: routing, capacity, dispatch, experts ------------------------------
def local_tensor(param):
    """This rank's experts: the local shard of an ep-sharded DTensor (differentiable: its
    gradient comes back as a DTensor with the same placement), or the tensor itself."""
    return param.to_local() if isinstance(param, DTensor) else param


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs, stacked: w1, w3 [num_experts, hidden, dim], w2 [num_experts,
    dim, hidden]. Stacked, dim 0 is the expert index, so Shard(0) on "ep" gives each ep rank
    whole experts and a checkpoint one tensor per weight, whatever --ep is."""

    def __init__(self, num_experts, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, rows, counts):
        """rows: tokens grouped by local expert, counts[j] of them for local expert j."""
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        outs = [(F.silu(x @ w1[j].T) * (x @ w3[j].T)) @ w2[j].T
                for j, x in enumerate(rows.split(counts))]
        return torch.cat(outs)


def capacity(num_tokens, capacity_factor, num_experts, top_k):
    """Routing choices one expert takes from one rank's micro-batch (None: no cap). Per
    rank, so the choices over the cap are dropped before they travel; the trade-off is that
    another world size drops other tokens (a resume at another world size with a cap is not
    the run it continues, though the one-process reference still matches each layout)."""
    if not capacity_factor:
        return None
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def balancing_loss(counts, probs, top_k, group):
    """Switch Transformer's auxiliary loss for top-k (arXiv:2101.03961, eq. 4) over the global
    micro-batch (every rank's tokens of this micro-step): E * sum_e f_e * P_e, f_e the share
    of routing choices that went to expert e, P_e its mean router probability; 1.0 for a
    uniform router. Only P_e has a gradient, so the counts are all-reduced (no gradient) and
    each rank returns its own tokens' term of the sum, times the world size: FSDP averages
    gradients over the ranks, and the average of these shares' gradients is the global
    loss's. Global, not per rank: the value does not depend on how the batch is split, so one
    process (group None) reproduces it, at any world size."""
    if group is not None:
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
    num_ranks = dist.get_world_size(group) if group is not None else 1
    num_tokens = counts.sum() // top_k  # of the global micro-batch
    share = counts.float() / (num_tokens * top_k)
    return num_ranks * probs.shape[-1] * (share * probs.sum(0) / num_tokens).sum()


def route(tokens, router, top_k, cap, num_groups=1):
    """Each token's top-k experts and gates (softmax over the chosen k), in fp32. Returns the
    kept routing choices sorted by expert (token index, gate), the count per expert before
    and after the cap, and the router probabilities. The cap applies within each of
    num_groups equal slices of the tokens: 1 on a rank (its micro-batch), the world size in
    the one-process reference, whose micro-batch is every rank's."""
    probs = torch.softmax(router(tokens).float(), dim=-1)
    top_probs, experts = probs.topk(top_k, dim=-1)
    gates = (top_probs / top_probs.sum(-1, keepdim=True)).flatten()
    flat, num_experts = experts.flatten(), probs.shape[-1]
    counts = torch.bincount(flat, minlength=num_experts)
    # Stable: within an expert, choices stay in token order, so the cap drops the latest.
    order, kept = torch.argsort(flat, stable=True), counts
    if cap is not None:
        index = torch.arange(flat.numel(), device=flat.device)
        key = index // (flat.numel() // num_groups) * num_experts + flat  # (group, expert)
        by_key = torch.argsort(key, stable=True)
        per_key = torch.bincount(key, minlength=num_groups * num_experts)
        slot = index - (torch.cumsum(per_key, 0) - per_key)[key[by_key]]
        survivors = by_key[slot < cap]
        order = survivors[torch.argsort(flat[survivors], stable=True)]
        kept = torch.bincount(flat[order], minlength=num_experts)
    return order // top_k, gates[order], counts, kept, probs


def dispatch_and_combine(rows, kept, experts, group):
    """Run the routed rows (sorted by expert) on the ranks that hold their experts and bring
    the results back in the same order. kept[e]: rows for expert e; experts are laid out ep
    rank by ep rank, so sorting by expert also sorts by destination rank."""
    if group is None:  # every expert is local: no communication at all
        return experts(rows, kept.tolist())
    ep_size = dist.get_world_size(group)
    send_counts = kept.view(ep_size, -1)  # [destination rank, its local expert]
    # 1. Counts first: the receiver must know its split sizes before the tokens arrive.
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_split = send_counts.sum(1).tolist()  # host reads: all_to_all_single needs ints
    recv_split = recv_counts.sum(1).tolist()
    # 2. Dispatch: an uneven all-to-all (its backward is the reverse all-to-all).
    received = funcol.all_to_all_single(rows, recv_split, send_split, group)
    # 3. Rows arrive source-major (source 0: expert 0.., expert 1..; source 1: ...); the
    #    experts want them expert-major.
    num_local = send_counts.shape[1]
    expert_of = torch.arange(num_local, device=rows.device).repeat(ep_size)
    expert_of = expert_of.repeat_interleave(recv_counts.flatten())
    by_expert = torch.argsort(expert_of, stable=True)
    out = experts(received[by_expert], recv_counts.sum(0).tolist())
    out = torch.empty_like(out).index_copy(0, by_expert, out)  # back to source-major
    # 4. Combine: the reverse all-to-all.
    return funcol.all_to_all_single(out, send_split, recv_split, group)


class MoEFeedForward(nn.Module):
    """Top-k mixture of SwiGLU experts in place of the block's MLP. The router is a dense
    parameter; the experts are ep-sharded by apply_expert_parallel(). After forward,
    `aux_loss` holds this rank's share of the balancing loss (see balancing_loss()) and
    `routed` its counts per expert (before the cap, and kept), for train_step() to read."""

    def __init__(self, cfg):
        super().__init__()
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.ffn_dim)
        self.top_k, self.capacity_factor = cfg.top_k, cfg.capacity_factor
        # Set by apply_expert_parallel; the one-process reference keeps the defaults, but for
        # num_groups: the number of ranks whose micro-batches it routes at once.
        self.ep_group, self.count_group, self.num_groups = None, None, 1
        self.aux_loss, self.routed = None, None

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        cap = capacity(tokens.shape[0] // self.num_groups, self.capacity_factor,
                       self.router.out_features, self.top_k)
        token_of, gates, counts, kept, probs = route(tokens, self.router, self.top_k, cap,
                                                     self.num_groups)
        out = dispatch_and_combine(tokens[token_of], kept, self.experts, self.ep_group)
        weighted = out * gates.unsqueeze(-1)
        # A dropped choice adds nothing: with both dropped, a token's MLP output is 0 and only
        # the residual carries it.
        combined = torch.zeros(tokens.shape, dtype=weighted.dtype, device=x.device)
        combined = combined.index_add(0, token_of, weighted)
        self.aux_loss = balancing_loss(counts, probs, self.top_k, self.count_group)
        self.routed = torch.stack([counts, kept]).detach()
        return combined.type_as(x).view(x.shape)


def build_moe_model(cfg):
    """The lab's model: the shared TinyLlama with each block's MLP a mixture of experts."""
    model = build_model(cfg)
    for block in model.layers.values():
        block.feed_forward = MoEFeedForward(cfg)
    return model


def moe_layers(model):
    return [block.feed_forward for block in model.layers.values()]


def apply_expert_parallel(model, ep_mesh, mesh):
    """Shard every block's experts over ep: Shard(0) of [num_experts, ...], so ep rank r holds
    experts r*E/ep .. (r+1)*E/ep - 1 and routes to the others with all-to-all. Run on the
    meta device: from_local makes the DTensors without any communication. mesh: all ranks,
    over which the balancing loss counts the routing choices."""
    for moe in moe_layers(model):
        moe.ep_group = ep_mesh.get_group() if ep_mesh.size() > 1 else None
        moe.count_group = mesh.get_group() if mesh.size() > 1 else None
        experts = moe.experts
        for name, param in list(experts.named_parameters()):
            local = torch.empty(param.shape[0] // ep_mesh.size(), *param.shape[1:],
                                device=param.device)
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            experts.register_parameter(name, nn.Parameter(sharded))


def build_mesh(cfg, device, world_size):
    """Three views of the same ranks. ("dp", "ep"), ep inner: an ep group is ep consecutive
    ranks (one node, on GPUs), where the all-to-alls run; "dp" shards the experts.
    ("dp_ep",): all ranks, for the dense parameters' fully_shard, which then averages each
    gradient over every token of the global batch."""
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    layout_mesh = init_mesh(device.type, (world_size // cfg.ep, cfg.ep), ("dp", "ep"), timeout)
    fsdp_mesh = init_mesh(device.type, (world_size,), ("dp_ep",), timeout)
    return layout_mesh, fsdp_mesh


def apply_activation_checkpointing(model):
    # torch.utils.checkpoint, non-reentrant: store only each block's input, recompute the rest
    # in backward. Wrapping forward in place (not in a wrapper module) keeps parameter names,
    # so init, checkpoints and the single-process reference all agree. The recomputed forward
    # runs the same all-to-alls again, on every rank of the ep group alike.
    for block in model.layers.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def apply_fsdp(model, layout_mesh, mesh, cfg, device):
    """fully_shard bottom-up. The experts first, over "dp" only (ep already splits them):
    their gradient on an ep rank is the sum over every rank of its ep group (the all-to-all's
    backward brings it), so the reduce-scatter over dp must divide by dp x ep = world size,
    not by dp, for the mean over the global batch. Then each block over all ranks (one
    all-gather in forward, one all-gather + one reduce-scatter in backward), and the root."""
    kwargs = {}
    param_dtype = fsdp_param_dtype(cfg, device.type)
    if param_dtype is not None:
        # Params are all-gathered and used in bf16 (or fp16); grads are reduced in fp32 so the
        # average over ranks does not lose bits. The sharded fp32 params stay the optimizer's
        # master copy.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                                   reduce_dtype=torch.float32)
    reshard = cfg.reshard_after_forward == "true"
    world_size, dp_size = mesh.size(), layout_mesh["dp"].size()
    for moe in moe_layers(model):
        # Shard(1), not dim 0: dim 0 is ep's, and num_experts/ep rows would rarely split
        # evenly over dp. Dim 1 (hidden, or dim for w2) does.
        fully_shard(moe.experts, mesh=layout_mesh["dp"], reshard_after_forward=reshard,
                    shard_placement_fn=lambda param: Shard(1), **kwargs)
        moe.experts.set_gradient_divide_factor(world_size)
        # A factor other than dp makes FSDP reduce with NCCL's PREMUL_SUM (scale, then sum, in
        # one kernel), which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): there,
        # a plain SUM, then the division. Not at dp 1, where nothing is reduced: torch 2.13
        # then divides by the factor twice (once in the copy, once after); parity shows it.
        moe.experts.set_force_sum_reduction_for_comms(device.type != "cuda" and dp_size > 1)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **kwargs)
    # The root keeps its params gathered after forward by default: backward starts with them.
    fully_shard(model, mesh=mesh, **kwargs)
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
    repeated on every rank; no communication at all). A real large model loads its shards
    from a DCP checkpoint instead."""
    for name, param in model.named_parameters():
        local = shard_of(initial_value(name, param.shape, seed), param)
        assert param.to_local().shape == local.shape, (name, param.to_local().shape, local.shape)
        param.to_local().copy_(local)


def build_fsdp_model(cfg, layout_mesh, mesh, device):
    with torch.device("meta"):  # shapes only: no rank allocates the full model
        model = build_moe_model(cfg)
        apply_expert_parallel(model, layout_mesh["ep"], mesh)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, layout_mesh, mesh, cfg, device)
    # Allocate only the local shards, then fill them.
    model.to_empty(device=device)
    init_sharded_weights(model, cfg.seed)
    return model


def build_optimizer(cfg, model):
    # One param group per mesh: AdamW's foreach kernels take one list per group, and DTensors
    # on different meshes (dense: dp_ep; experts: dp x ep) cannot share a foreach call.
    groups = {}
    for param in model.parameters():
        key = param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else None
        groups.setdefault(key, []).append(param)
    return torch.optim.AdamW([{"params": p} for p in groups.values()], lr=cfg.lr)


# lean: begin inspection
def inspect_expert_parallel(model, layout_mesh, mesh, cfg):
    """What each rank holds: dense params Shard(0) over all ranks; each expert weight a
    DTensor on ("dp", "ep") with (Shard(1), Shard(0)): whole experts split over ep, their
    rows over dp. Returns {name: [placements, global shape, local shape of this rank]}."""
    dp_size, ep_size = layout_mesh.shape
    layout = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        if ".experts." in name:
            assert param.device_mesh.mesh_dim_names == ("dp", "ep"), name
            assert tuple(param.placements) == (Shard(1), Shard(0)), (name, param.placements)
            rows = math.ceil(param.shape[1] / dp_size)
            local_rows = max(0, min(rows, param.shape[1] - rows * layout_mesh.get_local_rank(0)))
            assert param.to_local().shape == (cfg.num_experts // ep_size, local_rows,
                                              *param.shape[2:]), name
        else:
            assert param.device_mesh == mesh and tuple(param.placements) == (Shard(0),), name
        layout[name] = [str(tuple(param.placements)), list(param.shape),
                        list(param.to_local().shape)]
    return layout
# lean: end


@contextlib.contextmanager
def gradient_sync(model, enabled):
    """Accumulation micro-steps skip communication: FSDP keeps unsharded grads and skips the
    reduce-scatter (more memory until the last micro-step). The all-to-alls still run."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    yield


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def clip_grad_norm(parameters, max_norm):
    """clip_grad_norm_ for parameters on several meshes: torch's stacks every per-parameter
    norm into one tensor, which DTensors on different meshes cannot join. Here every element
    of every gradient lives on exactly one rank (Shard placements only, never Replicate), so
    the squared global norm is one all-reduce of each rank's local sum of squares. One host
    read per step, for the scale factor."""
    grads = [p.grad for p in parameters if p.grad is not None]
    square = torch.stack([local_tensor(g).float().pow(2).sum() for g in grads]).sum()
    if isinstance(grads[0], DTensor):
        assert all(isinstance(g, DTensor) and all(isinstance(p, Shard) for p in g.placements)
                   for g in grads), "a replicated gradient would be counted more than once"
        dist.all_reduce(square)
    total = square.sqrt().item()
    scale = min(1.0, max_norm / (total + 1e-6))
    for grad in grads:
        grad.mul_(scale)
    return total


def new_stats(cfg, device):
    """What train_step() records: routing choices per block and expert, before the cap and
    kept ([layers, 2, experts], summed over steps), and each step's gradient norm."""
    return {"routed": torch.zeros(cfg.num_layers, 2, cfg.num_experts, dtype=torch.long,
                                  device=device), "grad_norms": []}


def train_step(model, optimizer, scaler, batches, cfg, device, amp_dtype, stats):
    """One optimizer step of grad_accum micro-steps. Returns (loss on the device, data-wait
    seconds); adds to stats (new_stats())."""
    data_s, total_loss = 0.0, 0.0
    for micro in range(cfg.grad_accum):
        t0 = time.perf_counter()
        inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        data_s += time.perf_counter() - t0
        with gradient_sync(model, micro == cfg.grad_accum - 1):
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(inputs)
            layers = moe_layers(model)
            aux = torch.stack([moe.aux_loss for moe in layers]).mean()
            stats["routed"] += torch.stack([moe.routed for moe in layers])
            loss = (loss_fn(logits, targets) + cfg.aux_weight * aux) / cfg.grad_accum
            scaler.scale(loss).backward()
        total_loss += loss.detach()
    if cfg.clip:
        scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
        stats["grad_norms"].append(clip_grad_norm(list(model.parameters()), cfg.clip))
    scaler.step(optimizer)  # skips the step if fp16 gradients overflowed (on any rank)
    scaler.update()
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
    # layout (experts: whole [num_experts, ...] tensors), so another world size or --ep can
    # load them (each rank reads only the slices it needs).
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "step": step,
            "data": {"samples_seen": step * cfg.batch_size}, f"rng_rank{rank}": torch.get_rng_state()}


def save_checkpoint(cfg, model, optimizer, step, rank):
    save_checkpoint_atomically(cfg, checkpoint_state(cfg, model, optimizer, step, rank), step, rank)


def load_checkpoint(cfg, model, optimizer, rank):
    """Resume from the newest complete checkpoint, at any world size and --ep. Returns the
    data position as a step count (samples seen / global batch)."""
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
    """One torch.save file of plain tensors: `build_moe_model(cfg).load_state_dict(
    torch.load(path, weights_only=True))` works in a single process, with no
    torch.distributed at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


# lean: begin the single-process parity reference
def train_reference(cfg, world_size, device):
    """The single-process run the sharded one must match: same init, every expert local, no
    all-to-all. Each micro-step is every rank's micro-batch of that micro-step at once (the
    balancing loss is over exactly those tokens), routed with the cap applied per rank's
    slice, as the ranks apply it."""
    torch.manual_seed(cfg.seed)
    model = build_moe_model(cfg).to(device)
    model.init_weights(cfg.seed)
    for moe in moe_layers(model):
        moe.num_groups = world_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    streams = [micro_batches(cfg, r, world_size, 0) for r in range(world_size)]

    def global_micro_batches():
        while True:
            inputs, targets = zip(*(next(stream) for stream in streams))
            yield torch.cat(inputs), torch.cat(targets)

    batches = global_micro_batches()
    stats = new_stats(cfg, device)
    losses = []
    for step in range(1, cfg.steps + 1):
        set_learning_rate([optimizer], cfg, step)
        fp32 = make_grad_scaler(None, device)  # disabled: the reference runs in fp32
        losses.append(train_step(model, optimizer, fp32, batches, cfg, device, None,
                                 stats)[0].item())
    return model, losses, stats


def check_parity(cfg, full_state, world_size, device):
    """Max |param diff| against the reference, and its routing and gradient norms."""
    reference, ref_losses, stats = train_reference(cfg, world_size, device)
    max_diff = max((full_state[name].to(device) - param).abs().max().item()
                   for name, param in reference.named_parameters())
    return max_diff, ref_losses, {"reference_expert_load": stats["routed"][:, 0].tolist(),
                                  "reference_grad_norms": stats["grad_norms"]}


# Float reassociation moves the norms by ~1e-6 (relative) over 40 steps; a wrong expert
# gradient divide factor (dp instead of dp x ep) moves them by 1e-2 and more.
GRAD_NORM_RTOL = 1e-4


def grad_norm_diff(metrics):
    """Max relative difference of each step's gradient norm from the reference's (after a
    resume, the run's steps are the reference's last ones). Unlike the parameters, which
    AdamW makes nearly blind to a gradient's scale, this sees a wrong divide factor."""
    mine = metrics["grad_norms"]
    theirs = metrics.get("reference_grad_norms", [])[-len(mine):] if mine else []
    return max((abs(a - b) / b for a, b in zip(mine, theirs)), default=None)
# lean: end


def build(cfg, world_size, device):
    """Model, optimizer, and the two meshes (layout, dense FSDP)."""
    layout_mesh, mesh = build_mesh(cfg, device, world_size)
    model = build_fsdp_model(cfg, layout_mesh, mesh, device)
    return model, build_optimizer(cfg, model), layout_mesh, mesh


def train(cfg, rank, world_size, device):
    torch.manual_seed(cfg.seed)
    model, optimizer, layout_mesh, mesh = build(cfg, world_size, device)
    layout = inspect_expert_parallel(model, layout_mesh, mesh, cfg)  # lean: drop
    start_step = load_checkpoint(cfg, model, optimizer, rank) if cfg.checkpoint_dir else 0
    # --amp is autocast (as in lab01); --mixed-precision is FSDP's own policy, which is what
    # halves the all-gathers.
    amp_dtype = compute_dtype(cfg, device.type)
    param_dtype = fsdp_param_dtype(cfg, device.type)
    scaler = make_grad_scaler(torch.float16 if torch.float16 in (amp_dtype, param_dtype)
                              else None, device)
    # Every rank reads its own sequences (the ranks of an ep group too: they share experts,
    # not data).
    batches = micro_batches(cfg, rank, world_size, start_step, pin_memory=device.type == "cuda")
    last_step = cfg.stop_at_step or cfg.steps
    log = StepLog(cfg, device, start_step, last_step, loss_divisor=world_size)
    stats = new_stats(cfg, device)
    if rank == 0:
        num_params = sum(p.numel() for p in model.parameters())
        print(f"{LAB_NAME} | {dist.get_backend()} x{world_size} | {device} | "
              f"mesh {dict(zip(layout_mesh.mesh_dim_names, layout_mesh.shape))}, "
              f"{cfg.num_experts} experts top-{cfg.top_k} | "
              f"autocast {precision_name(amp_dtype)}, FSDP params {precision_name(param_dtype)} | "
              f"{num_params:,} params | steps {start_step + 1}..{last_step}", flush=True)

    def step_fn(step):
        set_learning_rate([optimizer], cfg, step)
        return train_step(model, optimizer, scaler, batches, cfg, device, amp_dtype, stats)

    train_loop(cfg, rank, device, start_step, log, step_fn,
               lambda step: save_checkpoint(cfg, model, optimizer, step, rank))
    report = {"mesh": layout_mesh, "log": log, "stats": stats,
              "precision": {"autocast": precision_name(amp_dtype),
                            "fsdp_params": precision_name(param_dtype)}}
    report.update(layout=layout)  # lean: drop
    return model, log, report


def gather_report(model, report, world_size, device):
    """Per-rank measurements, gathered to every rank (rank 0 writes them)."""
    mine = {"peak": peak_memory_bytes(device), "data_share": report["log"].data_share()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    per_rank = {k: [r.get(k) for r in everyone] for k in mine}
    routed = report["stats"]["routed"].clone()
    dist.all_reduce(routed)  # every rank's routing choices, this run's steps
    mesh = report["mesh"]
    result = {
        "peak_mem_bytes_per_rank": per_rank["peak"], "data_share_per_rank": per_rank["data_share"],
        "num_params": sum(p.numel() for p in model.parameters()),
        "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)),
        # Per block, per expert: routing choices over all ranks and steps, before the cap.
        "expert_load": routed[:, 0].tolist(),
        "tokens_dropped": int((routed[:, 0] - routed[:, 1]).sum()),
        # The global norm before clipping, the same on every rank.
        "grad_norms": report["stats"]["grad_norms"],
    }
    result.update(layout=report["layout"])  # lean: drop
    return result


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
    parity, ref_losses, reference = None, None, {}
    if cfg.check_parity and rank == 0:
        parity, ref_losses, reference = check_parity(cfg, full_state, world_size, device)
    # lean: end
    if cfg.export and rank == 0:
        export_consolidated(full_state, cfg.export)
    dist.barrier()  # the other ranks wait (within --timeout-s) for rank 0
    if rank == 0:
        metrics = {**common_metrics(cfg, log, world_size, device, wall_start, usage),
                   "ep": cfg.ep, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
                   "precision": report["precision"], **extra}
        # lean: begin the parity report
        metrics.update(parity_metrics(cfg, parity, ref_losses))
        metrics.update(reference)
        metrics["grad_norm_max_rel_diff"] = grad_norm_diff(metrics)
        # lean: end
        if cfg.metrics_out:
            write_json_atomic(cfg.metrics_out, metrics)
        print(summary_line(metrics), flush=True)
        # lean: begin the parity verdicts
        exit_if_parity_fails(parity, cfg.parity_tol)
        if (metrics["grad_norm_max_rel_diff"] or 0) > GRAD_NORM_RTOL:
            sys.exit(f"parity check failed: gradient norms differ from the reference by "
                     f"{metrics['grad_norm_max_rel_diff']:.2e} (relative) > {GRAD_NORM_RTOL:.0e}")
        # lean: end


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
