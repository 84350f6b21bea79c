"""Lab 05: 3-D parallelism, pipeline x FSDP x tensor parallel in one job.

What it teaches: the three axes of the earlier labs, composed on one ("pp", "dp", "tp") mesh
in torchtitan's order. First the model is cut into pipeline stages (lab04); then, inside each
stage, every block gets the Megatron tensor-parallel plan over "tp" (lab03); then FSDP shards
each block over "dp" (lab02). A rank at mesh coordinates (p, d, t) runs stage p's layers,
holds the t-th column or row slice of each of their weights, and of that slice only the d-th
FSDP shard. Sends and receives go over "pp", TP's all-reduces over "tp", FSDP's all-gathers and
reduce-scatters over "dp". Every rank prints its coordinates and what it holds.
`--check-parity` retrains in one process on the same global batches: every parameter after the
last step, the first step's gradients and every loss must match within 1e-5 (fp32 on CPU).
Checkpoints are DCP, keyed by the whole model's names: save on one layout, resume on another
(2 x 2 x 2, then 1 x 2 x 4, then one process) and the losses continue as if uninterrupted.

Launch (the same file everywhere; the backend follows the hardware):
    torchrun --nproc-per-node 8 labs/lab05_3d.py --check-parity     # auto: pp 2 x dp 2 x tp 2
    torchrun --nproc-per-node 8 labs/lab05_3d.py --pp 1 --dp 2 --tp 4 --check-parity
    torchrun --nproc-per-node 8 labs/lab05_3d.py --pp 4 --dp 1 --tp 2 \\
        --schedule Interleaved1F1B --check-parity                      # 8 stages on 4 pp ranks
    python labs/lab05_3d.py                                         # one process: 1 x 1 x 1
    # two nodes of 8 GPUs (run on each; same --rdzv-id everywhere; --checkpoint-dir must be on
    # a filesystem every node sees): tp inside a node, pp across the nodes.
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29400 --rdzv-id $JOB_ID labs/lab05_3d.py \\
        --pp 2 --dp 2 --tp 4 --num-layers 16 --microbatches 8 --batch-size 64

--pp x --dp x --tp must equal the world size (anything else: one line, exit 2); give all
three, or none for `auto_layout()`: tp 2 and pp 2 where the world size allows. Schedules:
GPipe and 1F1B (one stage per rank), Interleaved1F1B (--stages-per-rank V, default 2).
Expected last line (first command above; numbers vary slightly with hardware):
    done | lab05_3d | gloo x8 | 20 steps | loss 1.27... | parity 3.7e-07 | ...
Lesson: lessons/05_3d.py. Runbooks: runbooks/collective-timeout.md, stuck-rank.md,
oom-mitigations.md.

Use it in your project:
  - Replace: `build_model()`, keeping blocks in a dict keyed by index (names stay the whole
    model's) and a forward that skips a None embedding, norm or output; `block_plan()` and
    `root_plan()` for other layer names; `loss_fn()`; `SyntheticSequences`.
  - Keep: the order in `build_stage_module()` (cut, TP, FSDP, then materialise); `init_mesh()`
    (every axis gets the job's timeout); `clip_grad_norm()`, which counts each gradient
    element once over all three axes; checkpoints keyed by whole-model names (any layout).
  - Pitfalls: "tp" is the innermost axis of `build_mesh()`, so a TP group is --tp consecutive
    ranks: keep it inside one node. --num-heads, --num-kv-heads, --ffn-dim and --vocab-size
    must divide by --tp. Under PP, `apply_fsdp()` keeps each stage's weights gathered for the
    whole step (reshard_after_forward=False, as torchtitan does): memory for one all-gather
    per step, not one per microbatch (runbooks/oom-mitigations.md). A rank that skips a step
    leaves its pipeline, TP and FSDP peers waiting (runbooks/stuck-rank.md).
"""

import argparse
import datetime
import gc
import json
import inspect
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
import warnings
import zlib
from fnmatch import fnmatch
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.pipelining as pipelining
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module)
from torch.utils.data import DataLoader, Dataset, DistributedSampler

LAB_NAME = "lab05_3d"


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


# The schedules this lab runs, named as their class without "Schedule" (lab04 runs them all).
# placement "loop": stage s on pp rank s % pp. stages_per_rank: fixed by the schedule, or None
# when --stages-per-rank V chooses it. microbatches: what the class constructor demands of m
# ("per_stage": m >= number of stages; "rounds": m in max(1, m // pp) equal rounds).
SCHEDULES = {
    # Fill all forwards, then drain all backwards: m microbatches of activations held at once.
    "GPipe": dict(placement="loop", stages_per_rank=1, microbatches="any", since="2.4"),
    # Warm up with pp - rank forwards, then alternate: at most pp - rank microbatches in flight.
    "1F1B": dict(placement="loop", stages_per_rank=1, microbatches="per_stage", since="2.4"),
    # Megatron's interleaving: V stages per rank cut the bubble by V, for V x more sends.
    "Interleaved1F1B": dict(placement="loop", stages_per_rank=None, microbatches="rounds",
                            since="2.4"),
}


def microbatch_problem(rule, m, pp_size, num_stages):
    """Why the schedule class would refuse m microbatches, or None."""
    if rule == "per_stage" and m < num_stages:
        return f"needs >= {num_stages} (one per stage), got {m}"
    rounds = max(1, m // pp_size)
    if rule == "rounds" and m % rounds:
        return f"runs in max(1, m // pp) = {rounds} rounds, and {m} does not divide by {rounds}"
    return None


def schedule_class(name):
    """The schedule class, or None when the installed torch predates it."""
    return getattr(pipelining, f"Schedule{name}", None)


def parse_config(argv=None):
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    arg = parser.add_argument
    arg("--pp", type=int, default=0,
        help="pipeline-parallel degree, stages across ranks (0 with --dp and --tp 0: auto)")
    arg("--dp", type=int, default=0,
        help="data-parallel degree: FSDP shards every block over this axis (0: auto)")
    arg("--tp", type=int, default=0,
        help="tensor-parallel degree: every block's matmuls split over this axis, inside one "
             "node (0: auto; auto is tp 2 and pp 2 where the world size allows, dp the rest)")
    arg("--schedule", choices=list(SCHEDULES), default="1F1B",
        help="pipeline schedule (the torch class name without 'Schedule')")
    arg("--microbatches", type=int, default=4,
        help="microbatches per optimizer step; each dp replica splits its batch into this many")
    arg("--stages-per-rank", type=int, default=0,
        help="stages (model chunks) per pp rank; 0 = what the schedule needs (1, or 2 for "
             "Interleaved1F1B)")
    # 20 steps, not 40: the default run is 8 processes, and on a 2-core laptop it must stay
    # under 30 s (each step costs about 0.5 s there, mostly the oversubscribed collectives).
    parser.set_defaults(steps=20)
    cfg = parser.parse_args(argv)
    if cfg.model == "debug":
        # Each dp replica's batch is split into --microbatches: 16 sequences, not 8. And the
        # layers default to the smallest multiple of the stage count >= 4 (see validate_pipeline).
        cfg.micro_batch_size = cfg.micro_batch_size or 16
        cfg.num_layers = cfg.num_layers or 0
    elif cfg.micro_batch_size is None:  # each microbatch the preset's micro-batch size
        cfg.micro_batch_size = MODEL_PRESETS[cfg.model]["micro_batch_size"] * cfg.microbatches
    world_size = planned_world_size(cfg)
    apply_model_preset(cfg)  # validate_pipeline cuts the model's layers into stages
    validate_layout(cfg, world_size)
    validate_pipeline(cfg)
    validate_common(cfg, world_size, dp_size=cfg.dp)
    validate_microbatches(cfg)
    plan_or_refuse(cfg, plan_layout(cfg, world_size), world_size)
    return cfg


def auto_layout(world_size):
    """(pp, dp, tp) when none is given: tp 2, then pp 2, where the world size divides, dp the
    rest. 8 ranks: 2 x 2 x 2; 4: 2 x 1 x 2; 2: 1 x 1 x 2; one process: 1 x 1 x 1."""
    tp = 2 if world_size % 2 == 0 else 1
    pp = 2 if (world_size // tp) % 2 == 0 else 1
    return pp, world_size // (pp * tp), tp


def validate_layout(cfg, world_size):
    """--pp x --dp x --tp must be the world, and TP must split every sharded dimension evenly."""
    if cfg.pp == cfg.dp == cfg.tp == 0:
        cfg.pp, cfg.dp, cfg.tp = auto_layout(world_size)
    for flag in ("pp", "dp", "tp"):
        if getattr(cfg, flag) <= 0:
            fail_config(f"--{flag}", f"must be > 0, got {getattr(cfg, flag)} (give all three "
                        "of --pp, --dp, --tp, or none for the automatic layout)")
    if cfg.pp * cfg.dp * cfg.tp != world_size:
        fail_config("--pp/--dp/--tp", f"{cfg.pp} x {cfg.dp} x {cfg.tp} = "
                    f"{cfg.pp * cfg.dp * cfg.tp} ranks, but the world size is {world_size}: "
                    "give a layout whose product is the world size")
    # Colwise splits heads and the FFN's hidden width; Rowwise splits the vocabulary rows of
    # the embedding; the output projection splits the vocabulary columns.
    for flag, value in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                        ("ffn_dim", cfg.ffn_dim), ("vocab_size", cfg.vocab_size)):
        if value % cfg.tp:
            fail_config(f"--{flag.replace('_', '-')}", f"{value} must divide by --tp {cfg.tp}")


def plan_layout(cfg, world_size):
    """What the busiest rank (the first stage: most microbatches in flight) holds."""
    num_stages = cfg.pp * cfg.stages_per_rank
    in_flight = cfg.microbatches if cfg.schedule == "GPipe" else min(cfg.microbatches,
                                                                     num_stages)
    return {"mesh": f"pp={cfg.pp}, dp={cfg.dp}, tp={cfg.tp}",
            "what": f"{cfg.schedule}, {cfg.stages_per_rank} stage(s) of "
                    f"{cfg.num_layers // num_stages} block(s) per pp rank, each block "
                    "TP-split over tp and fully_shard over dp",
            "precision": "autocast in every stage; MixedPrecisionPolicy over dp: params "
                         "gathered in the compute dtype, grads reduced in fp32",
            "state_shards": cfg.dp * cfg.tp, "optimizer_shards": cfg.dp * cfg.tp, "tp": cfg.tp,
            "layers": cfg.stages_per_rank * cfg.num_layers // num_stages,
            "in_flight": in_flight,
            "micro_batch": cfg.batch_size // (cfg.dp * cfg.microbatches),
            "fsdp": True, "ddp_buckets": False}


def validate_pipeline(cfg):
    """Reject what the schedule classes would reject, before any process exists to hang."""
    spec = SCHEDULES[cfg.schedule]
    if schedule_class(cfg.schedule) is None:
        fail_config("--schedule", f"{cfg.schedule} needs torch >= {spec['since']}, "
                    f"this is {torch.__version__}")
    if cfg.grad_accum != 1:
        fail_config("--grad-accum", "must be 1: pipeline microbatches already accumulate "
                    "gradients; use --microbatches")
    if cfg.microbatches <= 0:
        fail_config("--microbatches", f"must be > 0, got {cfg.microbatches}")
    fixed = spec["stages_per_rank"]
    if cfg.stages_per_rank == 0:
        cfg.stages_per_rank = fixed or 2
    elif fixed and cfg.stages_per_rank != fixed:
        fail_config("--stages-per-rank", f"{cfg.schedule} runs exactly {fixed} stage(s) per "
                    f"rank, got {cfg.stages_per_rank}")
    num_stages = cfg.pp * cfg.stages_per_rank
    if cfg.num_layers == 0:  # debug's default: the smallest multiple of the stages >= 4
        cfg.num_layers = num_stages * math.ceil(4 / num_stages)
    if cfg.num_layers % num_stages:
        fail_config("--num-layers", f"{cfg.num_layers} must split evenly into pp x "
                    f"stages-per-rank = {cfg.pp} x {cfg.stages_per_rank} = {num_stages} stages")


def validate_microbatches(cfg):
    num_stages = cfg.pp * cfg.stages_per_rank
    if cfg.batch_size % (cfg.dp * cfg.microbatches):
        fail_config("--microbatches", f"--batch-size {cfg.batch_size} must split into --dp x "
                    f"--microbatches = {cfg.dp} x {cfg.microbatches} equal microbatches")
    problem = microbatch_problem(SCHEDULES[cfg.schedule]["microbatches"], cfg.microbatches,
                                 cfg.pp, num_stages)
    if problem:
        fail_config("--microbatches", f"{cfg.schedule} with {num_stages} stages on {cfg.pp} "
                    f"ranks {problem}")


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



# The point of the lab: cut the model into stages, then TP inside each block, then FSDP.
def build_mesh(cfg, device):
    # torchtitan's order, outermost first: "pp" across nodes (one activation per microbatch
    # per cut: the lightest traffic), "dp" next, "tp" innermost, so a TP group is --tp
    # consecutive ranks, which torchrun places on one node (its all-reduces need NVLink).
    # Rank r sits at arange(world).view(pp, dp, tp)[p, d, t].
    return init_mesh(device.type, (cfg.pp, cfg.dp, cfg.tp), ("pp", "dp", "tp"),
                     datetime.timedelta(seconds=cfg.timeout_s))


def stage_ids_for_rank(pp_rank, pp_size, cfg):
    """The stages this pp rank runs, in the order the schedule expects them."""
    return [pp_rank + k * pp_size for k in range(cfg.stages_per_rank)]


def block_plan():
    """TP plan of one block, keys relative to the block (lab03's, without sequence parallel).
    Megatron-LM (arXiv:1909.08053 sec. 3): column-parallel then row-parallel, so each half of
    the block costs one all-reduce forward and one backward."""
    def gather_input():
        # The input is replicated over tp; backward all-reduces its gradient once (Megatron's
        # "f"). use_local_output=False hands wq/wk/wv (w1/w3) one DTensor: one collective.
        return PrepareModuleInput(input_layouts=(Replicate(),),
                                  desired_input_layouts=(Replicate(),), use_local_output=False)

    return {
        "attention": gather_input(),
        "attention.wq": ColwiseParallel(),  # split output features = split heads
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),  # partial sums, all-reduced (Megatron's "g")
        "feed_forward": gather_input(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def root_plan(module):
    """The embedding (first stage only) and the output projection (last stage only)."""
    plan = {}
    if module.tok_embeddings is not None:
        # Vocab-sharded table: each rank looks up the rows it owns, the partial sums are
        # all-reduced. The stage's output is then a plain, replicated tensor to send on "pp".
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if module.output is not None:
        # Vocab-sharded projection, gathered to full logits for the schedule's loss_fn.
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
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


# The last stage's root FSDP module returns its logits as a view, and FSDP2 warns (once per
# rank) that an in-place op on such a view would skip its pre-backward hook. Nothing here
# modifies the logits in place: the schedule's loss_fn only reads them. The filter names this
# one message and module, so any other FSDP warning still shows.
warnings.filterwarnings("ignore", category=UserWarning,
                        message=r"FSDP2-wrapped module \(FSDPTinyLlama\) returned a view tensor")


def apply_tp(module, tp_mesh):
    for block in module.layers.values():
        plan = block_plan()
        check_plan_keys(block, plan)
        parallelize_module(block, tp_mesh, plan)
    plan = root_plan(module)
    if plan:
        check_plan_keys(module, plan)
        parallelize_module(module, tp_mesh, plan)


def apply_fsdp(module, dp_mesh, low_dtype):
    """Shard one stage over "dp", after TP: fully_shard shards the tp-sharded DTensors again
    over "dp" (2-D placements), and its all-gather rebuilds exactly the tp-local slice TP's
    hooks expect. One FSDP unit per block, the stage's root holds embedding, norm and output."""
    # reshard_after_forward=False (torchtitan's default under PP): with True, each of the m
    # microbatch forwards would all-gather the stage's parameters again.
    # Low precision (bf16 on CUDA by default): gathered and used in it, reduced in fp32.
    mp_policy = (MixedPrecisionPolicy(param_dtype=low_dtype, reduce_dtype=torch.float32)
                 if low_dtype is not None else MixedPrecisionPolicy())
    for block in module.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)


@torch.no_grad()
def init_sharded_weights(module, seed):
    """Each shard gets its slice of initial_value(name, full shape): the weights the
    single-process reference has, on any layout. Every rank builds the full tensor and keeps
    its piece; a large model would generate only the local shard."""
    # src_data_rank=None (torch >= 2.7): slice locally. Before, rank 0 scatters an identical copy.
    local_only = ({"src_data_rank": None} if "src_data_rank" in
                  inspect.signature(distribute_tensor).parameters else {})
    for name, param in module.named_parameters():
        full = initial_value(name, param.shape, seed).to(param.device)
        shard = distribute_tensor(full, param.device_mesh, param.placements, **local_only)
        param.to_local().copy_(shard.to_local())


def build_stage_module(cfg, stage_id, num_stages, mesh, device, low_dtype):
    """Stage stage_id of the whole model, TP'd over "tp" and sharded over "dp", in that order
    (torchtitan: pipeline_llm() splits the model, then parallelize_fn applies TP, then FSDP,
    to each part). Names stay the whole model's (layers.5.attention.wq.weight), so the
    weights equal the reference's and checkpoint keys do not depend on the layout."""
    with torch.device("meta"):  # no memory for anything before it is sharded
        module = build_model(cfg)
    per_stage = cfg.num_layers // num_stages
    keep = range(stage_id * per_stage, (stage_id + 1) * per_stage)
    for name in list(module.layers):
        if int(name) not in keep:
            del module.layers[name]
    if stage_id != 0:
        module.tok_embeddings = None  # TinyLlama.forward then takes hidden states as input
    if stage_id != num_stages - 1:
        module.norm, module.output = None, None
    apply_tp(module, mesh["tp"])
    apply_fsdp(module, mesh["dp"], low_dtype)
    module.to_empty(device=device)
    init_sharded_weights(module, cfg.seed)
    return module


def local_numel(module):
    return sum(p.to_local().numel() for p in module.parameters())


def describe_holdings(cfg, mesh, modules, stage_ids, rank):
    """One line per rank: where it sits on the mesh and what it holds."""
    coords = {name: mesh.get_local_rank(name) for name in ("pp", "dp", "tp")}
    parts = []
    for module, stage_id in zip(modules, stage_ids):
        what = [f"layers {','.join(module.layers)}"]
        what += [name for name in ("tok_embeddings", "output") if getattr(module, name) is not None]
        parts.append(f"stage {stage_id} ({' + '.join(what)})")
    wq = modules[0].layers[next(iter(modules[0].layers))].attention.wq.weight
    return (f"rank {rank} | pp {coords['pp']} dp {coords['dp']} tp {coords['tp']} | "
            f"{'; '.join(parts)} | {sum(map(local_numel, modules)):,} parameter elements | "
            f"wq {tuple(wq.shape)} held as {tuple(wq.to_local().shape)} (its heads split over "
            f"tp, then its rows over dp)")


# lean: begin inspection: the stages hold the whole model, each element exactly once
def inspect_layout(cfg, modules, stage_ids, num_stages, device):
    """Only this rank's layers, the embedding only on stage 0, norm + output only on the last
    stage, and over all ranks every parameter element exactly once after dividing out the
    tp replicas of the norms (the only weights TP leaves whole)."""
    per_stage = cfg.num_layers // num_stages
    for module, stage_id in zip(modules, stage_ids):
        expected = [str(i) for i in range(stage_id * per_stage, (stage_id + 1) * per_stage)]
        assert list(module.layers) == expected, (stage_id, list(module.layers))
        assert (module.tok_embeddings is not None) == (stage_id == 0)
        assert (module.output is not None) == (stage_id == num_stages - 1)
    counted = sum(p.to_local().numel() * (1 if sharded_over_tp(p) else 1 / cfg.tp)
                  for m in modules for p in m.parameters())
    total = torch.tensor([counted], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    with torch.device("meta"):
        whole = sum(p.numel() for p in build_model(cfg).parameters())
    assert round(total.item()) == whole, f"ranks hold {total.item()} elements, model {whole}"
# lean: end


def apply_stage_autocast(stage, device, dtype):
    """Autocast around each microbatch's forward (the schedule calls forward_one_chunk);
    backward reuses the dtypes the forward chose."""
    if dtype is None:
        return
    forward = stage.forward_one_chunk

    def autocast_forward(*args, **kwargs):
        with torch.autocast(device.type, dtype=dtype):
            return forward(*args, **kwargs)
    stage.forward_one_chunk = autocast_forward


def scaled_loss(scaler):
    """The schedule calls backward on what its loss_fn returns, so fp16 loss scaling goes in
    here (a pass-through when the scaler is disabled)."""
    return lambda output, target: scaler.scale(loss_fn(output, target))


def build_pipeline(cfg, device, amp_dtype, loss, rank):
    """Mesh, stages, schedule and one optimizer per stage module for this rank."""
    mesh = build_mesh(cfg, device)
    num_stages = cfg.pp * cfg.stages_per_rank
    stage_ids = stage_ids_for_rank(mesh.get_local_rank("pp"), cfg.pp, cfg)
    modules = [build_stage_module(cfg, s, num_stages, mesh, device, amp_dtype)
               for s in stage_ids]
    inspect_layout(cfg, modules, stage_ids, num_stages, device)  # lean: drop
    # One object per rank, once, printed by rank 0 in rank order: ranks printing at the same
    # time would interleave their lines.
    holdings = [None] * dist.get_world_size()
    dist.all_gather_object(holdings, describe_holdings(cfg, mesh, modules, stage_ids, rank))
    if rank == 0:
        print("\n".join(holdings), flush=True)
    # Sends and receives go over the pp sub-group only: the same (dp, tp) slot of each stage.
    stages = [PipelineStage(m, s, num_stages, device, group=mesh["pp"].get_group())
              for m, s in zip(modules, stage_ids)]
    for stage in stages:
        apply_stage_autocast(stage, device, amp_dtype)
    schedule_cls = schedule_class(cfg.schedule)
    # loss_fn is the mean over one microbatch; scale_grads (default) divides the summed
    # gradients by the number of microbatches, so they are the gradient of the batch mean.
    if SCHEDULES[cfg.schedule]["stages_per_rank"] == 1:
        schedule = schedule_cls(stages[0], n_microbatches=cfg.microbatches, loss_fn=loss)
    else:
        schedule = schedule_cls(stages, n_microbatches=cfg.microbatches, loss_fn=loss)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=cfg.lr) for m in modules]
    return mesh, stages, schedule, optimizers


def sharded_over_tp(param):
    """True for a TP'd weight (disjoint slices over "tp"); False for the norms, which TP leaves
    whole, so every tp rank holds the same copy (FSDP still shards them over "dp")."""
    return "tp" in (param.device_mesh.mesh_dim_names or ())


def clip_grad_norm(modules, max_norm, tp_rank, device):
    """clip_grad_norm_ over the whole model. Each rank's local gradients are a disjoint piece
    (its stages over pp, its shard over dp, its slice over tp), except the norms' gradients,
    identical on every tp rank: those are counted on tp rank 0 only. Then one all-reduce."""
    local = [p.grad.to_local() for m in modules for p in m.parameters() if p.grad is not None]
    counted = [p.grad.to_local() for m in modules for p in m.parameters()
               if p.grad is not None and (sharded_over_tp(p) or tp_rank == 0)]
    norms = [torch.linalg.vector_norm(g) for g in counted] or [torch.zeros((), device=device)]
    total_sq = torch.linalg.vector_norm(torch.stack(norms)).pow(2).reshape(1)
    dist.all_reduce(total_sq)
    total_norm = total_sq.sqrt()
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # as clip_grad_norm_ does
    for g in local:
        g.mul_(coef)
    return total_norm


def train_step(cfg, schedule, stages, optimizers, scaler, batch, device, tp_rank,
               grads_out=None):
    """One optimizer step: the schedule runs forward and backward of every microbatch."""
    inputs, targets = (t.to(device, non_blocking=True) for t in batch)
    holds_first = any(s.is_first for s in stages)
    holds_last = any(s.is_last for s in stages)
    losses = []  # filled with one loss per microbatch on the rank holding the last stage
    args = (inputs,) if holds_first else ()
    kwargs = {"target": targets, "losses": losses} if holds_last else {}
    schedule.step(*args, **kwargs)
    modules = [s.submod for s in stages]
    if grads_out is not None:  # lean: drop
        grads_out.update(named_full_tensors(modules, grads=True))  # lean: drop
    if not holds_last:
        scaler.scale(torch.zeros((), device=device))  # scale() creates the scale on first use
    for optimizer in optimizers:
        scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
    if cfg.clip:
        clip_grad_norm(modules, cfg.clip, tp_rank, device)
    # The recorded losses are scaled (fp16); get_scale() is 1.0 when the scaler is disabled.
    # Every tp rank of the last stage has the same loss; tp rank 0 reports it, so StepLog's
    # sum over all ranks, divided by dp, is the batch mean (no tp-fold sum to round).
    loss = (torch.stack(losses).mean() / scaler.get_scale() if holds_last and tp_rank == 0
            else torch.zeros((), device=device))
    for optimizer in optimizers:
        scaler.step(optimizer)  # skipped on every rank if any stage's fp16 grads overflowed
        optimizer.zero_grad(set_to_none=True)
    scaler.update()
    return loss.detach().reshape(1)


def pipeline_grad_scaler(dtype, device):
    """make_grad_scaler for a pipeline: each rank holds different parameters, so one stage's
    overflow must make every stage skip the step. ShardedGradScaler (public, in
    torch.distributed.fsdp) all-reduces the inf check over the group, here the whole world;
    torch.amp.GradScaler would check this rank's stages only."""
    return ShardedGradScaler(device.type, enabled=dtype == torch.float16,
                             process_group=dist.group.WORLD)


# lean: begin the single-process parity reference
def named_full_tensors(modules, grads=False):
    """{name: full tensor} of this rank's parameters (or their gradients). With FSDP,
    full_tensor() all-gathers the shards over dp: every dp rank calls it in the same order."""
    out = {}
    for module in modules:
        for name, param in module.named_parameters():
            value = param.grad if grads else param
            if value is not None:
                value = value.full_tensor() if isinstance(value, DTensor) else value
                out[name] = value.detach().float().cpu().clone()  # clipping is in place
    return out
# lean: end


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# lean: begin the single-process parity reference
def train_reference(cfg, num_steps, order):
    """The single-process run the pipeline must match: the whole model, same init, and each
    step accumulates the gradient of every microbatch of every dp replica in one process, then
    divides by their number (what scale_grads and FSDP's reduce-scatter average compute).
    `order` is the microbatch order the stage accumulated in (LoopedBFS runs backward last
    microbatch first): fp32 sums depend on order, and Adam turns a last-bit difference in a
    gradient entry near zero into a visible parameter difference."""
    model = build_model(cfg)
    model.init_weights(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    streams = [micro_batches(cfg, r, cfg.dp, 0) for r in range(cfg.dp)]
    num_chunks = cfg.dp * cfg.microbatches
    losses, first_grads = [], None
    for step in range(1, num_steps + 1):
        total = 0.0
        for stream in streams:
            inputs, targets = next(stream)
            chunks = list(zip(inputs.chunk(cfg.microbatches), targets.chunk(cfg.microbatches)))
            for x, y in (chunks[k] for k in order):
                loss = loss_fn(model(x), y)
                loss.backward()
                total += loss.item() / num_chunks
        for p in model.parameters():
            p.grad.div_(num_chunks)
        if step == 1:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if cfg.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        set_learning_rate([optimizer], cfg, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return dict(model.named_parameters()), first_grads, losses


def check_parity(cfg, stages, first_grads, losses, mesh):
    """full_tensor() gathers every parameter over dp and tp, so the ranks at dp 0, tp 0 (one
    per pp rank, rank 0 among them) hold their stages whole: they retrain the small reference
    and compare. One all-reduce MAX gives the worst difference anywhere. Returns (param, grad,
    loss) diffs; -1 where nothing was compared (no step 1 in a resumed run)."""
    modules = [s.submod for s in stages]
    params = named_full_tensors(modules)  # collective: every rank takes part
    device = next(modules[0].parameters()).device  # NCCL reduces only tensors on the GPU
    if mesh.get_local_rank("dp") or mesh.get_local_rank("tp"):
        worst = torch.full((3,), -1.0, dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return worst.tolist(), None
    # GPipe, 1F1B and Interleaved1F1B run every stage's backwards in microbatch order.
    ref_params, ref_grads, ref_losses = train_reference(cfg, losses[-1][0],
                                                        range(cfg.microbatches))
    param_diff = max((params[n] - ref_params[n].detach()).abs().max().item() for n in params)
    grad_diff = max(((first_grads[n] - ref_grads[n]).abs().max().item() for n in first_grads),
                    default=-1.0)  # -1: no step 1 in this run (resumed)
    loss_diff = max(abs(loss - ref_losses[step - 1]) for step, loss in losses)
    worst = torch.tensor([param_diff, grad_diff, loss_diff], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.tolist(), ref_losses
# lean: end


# Checkpoints: one DCP checkpoint for the whole pipeline. Every rank writes its own stages'
# tensors (and with FSDP its shards) under the whole model's names, so the files do not
# depend on pp, dp or the schedule.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # keys per parameter


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


def pipeline_state(modules, optimizers):
    """Per stage module: its model and optimizer state dicts, plus all of them merged."""
    parts = [(get_model_state_dict(m), get_optimizer_state_dict(m, o, options=OPTIM_OPTIONS))
             for m, o in zip(modules, optimizers)]
    merged = {"model": {k: v for part, _ in parts for k, v in part.items()},
              "optim": {k: v for _, part in parts for k, v in part.items()}}
    return parts, merged


def save_checkpoint(cfg, modules, optimizers, step, rank):
    save_checkpoint_atomically(cfg, pipeline_state(modules, optimizers)[1], step, rank)


def load_checkpoint(cfg, modules, optimizers, rank):
    path = latest_checkpoint(cfg.checkpoint_dir)
    if path is None:
        return 0
    parts, merged = pipeline_state(modules, optimizers)
    dcp.load(merged, checkpoint_id=path)  # each rank reads only the keys its stages own
    for (module, optimizer), (model_sd, optim_sd) in zip(zip(modules, optimizers), parts):
        set_model_state_dict(module, {k: merged["model"][k] for k in model_sd})
        set_optimizer_state_dict(module, optimizer, {k: merged["optim"][k] for k in optim_sd},
                                 options=OPTIM_OPTIONS)
    step = int(path.name.split("_")[1])
    if rank == 0:
        print(f"resumed from {path} at step {step}", flush=True)
    return step




def train(cfg, rank, device):
    amp_dtype = compute_dtype(cfg, device.type)
    scaler = pipeline_grad_scaler(amp_dtype, device)
    mesh, stages, schedule, optimizers = build_pipeline(cfg, device, amp_dtype,
                                                        scaled_loss(scaler), rank)
    modules = [s.submod for s in stages]
    tp_rank = mesh.get_local_rank("tp")
    start_step = load_checkpoint(cfg, modules, optimizers, rank)
    # Every rank of one dp slot (all its pp stages and tp slices) reads the same batches.
    batches = micro_batches(cfg, mesh.get_local_rank("dp"), cfg.dp, start_step,
                            pin_memory=device.type == "cuda")
    last_step = cfg.stop_at_step or cfg.steps
    log, first_grads = StepLog(cfg, device, start_step, last_step, loss_divisor=cfg.dp), {}
    if rank == 0:
        num_params = sum(math.prod(shape) for shape in parameter_shapes(cfg).values())
        print(f"{LAB_NAME} | {dist.get_backend()} x{dist.get_world_size()} | {device} | "
              f"{precision_name(amp_dtype)} | {num_params:,} params | {cfg.schedule} | pp "
              f"{cfg.pp} x dp {cfg.dp} x tp {cfg.tp} | {cfg.stages_per_rank} stage(s) per pp "
              f"rank | {cfg.microbatches} microbatches | steps {start_step + 1}..{last_step}",
              flush=True)

    def step_fn(step):
        set_learning_rate(optimizers, cfg, step)
        t0 = time.perf_counter()
        batch = next(batches)
        data_s = time.perf_counter() - t0
        # lean: begin the parity reference's step-1 gradients
        if cfg.check_parity and step == 1:
            return train_step(cfg, schedule, stages, optimizers, scaler, batch, device, tp_rank,
                              first_grads), data_s
        # lean: end
        return train_step(cfg, schedule, stages, optimizers, scaler, batch, device,
                          tp_rank), data_s

    train_loop(cfg, rank, device, start_step, log, step_fn,
               lambda step: save_checkpoint(cfg, modules, optimizers, step, rank))
    report = {"stages": stages, "log": log, "amp_dtype": amp_dtype}
    report.update(first_grads=first_grads, mesh=mesh)  # lean: drop
    return modules, report


def layout_metrics(cfg):
    return {"schedule": cfg.schedule, "pp_size": cfg.pp, "dp_size": cfg.dp, "tp_size": cfg.tp,
            "stages_per_rank": cfg.stages_per_rank, "num_microbatches": cfg.microbatches}


def run(cfg, rank, world_size, device, wall_start):
    """Train, check parity, report. Every model lives and dies in here."""
    modules, report = train(cfg, rank, device)
    log, stages, amp_dtype = report["log"], report["stages"], report["amp_dtype"]
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak_memory_bytes(device))
    usage = utilisation(cfg, log, world_size, device, amp_dtype)  # every rank at once
    # lean: begin the parity reference
    parity = grad_parity = loss_parity = ref_losses = None
    if cfg.check_parity:
        (parity, grad_parity, loss_parity), ref_losses = check_parity(
            cfg, stages, report["first_grads"], log.losses, report["mesh"])
        grad_parity = None if grad_parity < 0 else grad_parity  # resumed: no step 1 here
    # lean: end
    if rank == 0:
        metrics = {**common_metrics(cfg, log, world_size, device, wall_start, usage),
                   "precision": precision_name(amp_dtype), "peak_mem_bytes_per_rank": peaks,
                   **layout_metrics(cfg)}
        # lean: begin the parity report
        metrics.update(parity_metrics(cfg, parity, ref_losses),
                       grad_parity_max_abs_diff=grad_parity,
                       loss_parity_max_abs_diff=loss_parity)
        # lean: end
        if cfg.metrics_out:
            write_json_atomic(cfg.metrics_out, metrics)
        print(summary_line(metrics), flush=True)
        # lean: begin the parity verdict
        if parity is not None:
            worst = max(d for d in (parity, grad_parity, loss_parity) if d is not None)
            exit_if_parity_fails(worst, cfg.parity_tol, f" (the worst of params {parity:.1e}, "
                                 f"step-1 grads {grad_parity}, losses {loss_parity:.1e})")
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
