"""The flags every lab shares, the model presets behind --model, and their validation: a bad
value is refused with one line on stderr and exit status 2, before any process group starts.

A lab builds its parser with make_parser(), adds its own flags, then calls validate_common()
and its own checks."""

import math
import tempfile
from pathlib import Path

import torch

from labkit.checkpoint import checkpoint_step, checkpointed_batch_size, latest_checkpoint
from labkit.data import dataset_length, validate_data_file
from labkit.errors import OneLineErrorParser, fail_config, refuse_negative
from labkit.faults import add_drill_args, validate_drill_args
from labkit.loop import PROFILED_STEPS
from labkit.model import MODEL_PRESETS
from labkit.parity import add_parity_args, validate_parity_args
from labkit.plan import GPU_SPECS
from labkit.runtime import cuda_has_bf16, local_world_size, pick_device_type, world_size_from_env
from labkit.timeline import add_timeline_args


def make_parser(lab_name, docstring, count_comms=False, timeline=False, block_options=False):
    """The parser of one lab: the common flags, with the lab's name as cfg.lab. count_comms:
    the lab runs its first step in labkit/probes.py's StepCosts, which --count-comms turns on.
    timeline: the lab is a pipeline with labkit/timeline.py's probe (--timeline).
    block_options: the lab applies labkit/model.py's apply_block_options and exports (--export)."""
    parser = OneLineErrorParser(description=docstring.splitlines()[0])
    parser.set_defaults(lab=lab_name, count_comms=False)
    if count_comms:
        parser.add_argument("--count-comms", action="store_true",
                            help="measure step 1: collectives by type (CommDebugMode) and saved "
                                 "activation bytes")
    if timeline:
        add_timeline_args(parser)
    if block_options:
        add_block_options(parser)
    add_common_args(parser)
    add_parity_args(parser)
    add_drill_args(parser)
    return parser


def add_block_options(parser):
    arg = parser.add_argument
    arg("--activation-checkpointing", action="store_true",
        help="recompute each block's activations in backward instead of storing them")
    arg("--compile", action="store_true", help="torch.compile each block before sharding")
    arg("--compile-backend", default="inductor",
        help="torch.compile backend (aot_eager skips code generation; useful to bisect)")
    arg("--export", default="",
        help="write one consolidated state dict file here at the end (loads in one process)")


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
    arg("--profile-dir", default="",
        help="write a torch.profiler trace of steps 3-4 here, rank<N>.json per rank, for "
             "Perfetto or chrome://tracing (the run needs 4 steps or more)")
    arg("--metrics-stream", default="",
        help="append one JSON line per logged step here (rank 0): step, loss, step_s, "
             "tokens_per_s, data_share, mem_bytes, time")
    arg("--plan", action="store_true",
        help="print the layout, precision and memory per rank for --nproc ranks of --gpu, "
             "then exit; starts no process group and needs no GPU")
    arg("--nproc", type=int, default=0, help="--plan: world size to plan for (0: this launch's)")
    arg("--gpu", default="",
        help="--plan: the GPU to plan for, a GPU_SPECS key such as H100-80GB (default: this "
             "machine's device)")


def validate_common(cfg, world_size, dp_size):
    """Checks every lab shares. dp_size: the ranks that split the batch (world size over the
    model-parallel degrees); it fills in the default --batch-size."""
    apply_model_preset(cfg)
    for name, value in vars(cfg).items():  # float("nan") passes every <= check below
        if isinstance(value, float) and not math.isfinite(value):
            fail_config(f"--{name.replace('_', '-')}", f"must be a finite number, got {value}")
    refuse_negative(cfg, ["steps", "micro_batch_size", "grad_accum", "seq_len", "dim",
                          "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size",
                          "num_samples", "lr", "timeout_s", "log_every"], strictly_positive=True)
    refuse_negative(cfg, ["batch_size", "clip", "num_workers", "checkpoint_every",
                          "stop_at_step", "warmup_steps", "nproc"])
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
    validate_parity_args(cfg)
    validate_drill_args(cfg, world_size)
    if cfg.resume and not latest_checkpoint(cfg.checkpoint_dir):
        fail_config("--resume", f"no complete checkpoint in {cfg.checkpoint_dir}")
    if cfg.plan:
        return  # the rest is about this machine, which a plan does not need
    if cfg.checkpoint_dir:
        refuse_unwritable_directory("--checkpoint-dir", Path(cfg.checkpoint_dir))
    if cfg.profile_dir:
        if steps_this_launch(cfg) < PROFILED_STEPS:
            fail_config("--profile-dir", f"needs {PROFILED_STEPS} steps or more in this launch "
                        f"(it records steps 3-4 of them, after warm-up); this one runs "
                        f"{steps_this_launch(cfg)}")
        refuse_unwritable_directory("--profile-dir", Path(cfg.profile_dir))
    for flag, path in [("--metrics-out", cfg.metrics_out),
                       ("--metrics-stream", cfg.metrics_stream)]:
        if not path:
            continue
        if Path(path).is_dir():
            fail_config(flag, f"{path} is a directory; give a file path")
        refuse_unwritable_directory(flag, Path(path).parent)
    if cfg.device == "cuda" and torch.cuda.device_count() < local_world_size():
        fail_config("--device", f"cuda needs one GPU per local rank: {local_world_size()} ranks, "
                    f"{torch.cuda.device_count()} GPUs visible; use --device cpu")
    device_type = pick_device_type(cfg)
    if cfg.amp == "bf16" and device_type == "cuda" and not cuda_has_bf16():
        fail_config("--amp", f"bf16 needs an Ampere or newer GPU; {torch.cuda.get_device_name()} "
                    "has none: use --amp fp16 (or auto)")


def steps_this_launch(cfg):
    """The steps this launch runs: up to --stop-at-step or --steps, after the checkpoint that
    --resume continues from."""
    first = checkpoint_step(latest_checkpoint(cfg.checkpoint_dir)) if cfg.resume else 0
    return (cfg.stop_at_step or cfg.steps) - first


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
