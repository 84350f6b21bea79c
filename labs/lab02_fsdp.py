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
    python labs/lab02_fsdp.py --plan --model 8b --nproc 8 --gpu H100-80GB  # no GPU needed
    torchrun --nproc-per-node 8 labs/lab02_fsdp.py --model 1b --data train.bin  # real tokens
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

Copy it: this file and the folder labkit/ beside it (torch and the standard library only).
This file is FSDP, in the order it happens: the mesh, meta init, fully_shard per block then
the root, the mixed-precision policy, the optimizer after sharding, gradient sync control and
DCP. labkit/ holds the rest once (flags, model, data, the loop, metrics, --plan, the probes).

Use it in your project:
  - Replace: `build_model()` (run on the meta device by `build_fsdp_model()`); the loop over
    `model.layers` in `apply_fsdp()` (one unit per block of yours); `init_sharded_weights()`
    (labkit; pretrained weights: dcp.load into the sharded model, as `load_checkpoint()`
    does); `SyntheticSequences`; `loss_fn()`.
  - Keep: the order in `build_fsdp_model()`: meta device, fully_shard on blocks then the root,
    to_empty, fill (runbooks/oom-distributed-causes.md); `build_optimizer()` after it;
    `gradient_sync()`; DCP `save_checkpoint()` / `load_checkpoint()` (tmp dir, then rename;
    any world size); `--mixed-precision auto`: bf16 gathers on CUDA, fp32 shards and reduction.
  - Pitfalls: fully_shard replaces every parameter: an optimizer built before it trains
    nothing, silently. Sharding only the root gathers the whole model at once; one unit per
    Linear means many small collectives. dcp.save and `full_state_dict()` are collectives:
    never under `if rank == 0` (runbooks/collective-timeout.md). Out of memory:
    `--activation-checkpointing`, `--cpu-offload` (runbooks/oom-mitigations.md).
"""

import contextlib
import datetime
import math

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.checkpoint import (full_state_once, latest_checkpoint, restore_rng_state, rng_state,
                              save_dcp_atomically)
from labkit.data import micro_batches
from labkit.errors import fail_config
from labkit.flags import make_parser, planned_world_size, validate_common
from labkit.loop import announce, train_loop, train_step
from labkit.metrics import finish_run
from labkit.model import apply_block_options, build_model, init_sharded_weights
from labkit.plan import plan_or_refuse
from labkit.probes import FirstStepBytes, layout_report
from labkit.runtime import (compute_dtype, init_mesh, launch, make_grad_scaler,
                            precision_name)

LAB_NAME = "lab02_fsdp"


def parse_config(argv=None):
    parser = make_parser(LAB_NAME, __doc__, block_options=True)
    arg = parser.add_argument
    arg("--strategy", choices=["fsdp", "ddp", "zero1"], default="fsdp",
        help="fsdp: fully_shard (ZeRO-3); ddp: full replica; zero1: DDP + ZeroRedundancyOptimizer")
    arg("--reshard-after-forward", choices=["true", "false"], default="true",
        help="false keeps each block's gathered params from forward to backward (ZeRO-2-like)")
    arg("--mixed-precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
        help="FSDP's MixedPrecisionPolicy: params gathered and used in this dtype, grads "
             "reduced in fp32; auto = the --amp choice (bf16 on a GPU that has it, fp32 on cpu)")
    arg("--cpu-offload", action="store_true",
        help="keep sharded params, grads and optimizer step on the CPU (CPUOffloadPolicy)")
    arg("--hsdp", type=int, default=0, metavar="R",
        help="HSDP: replicate across R groups, shard within each (0: plain FSDP)")
    cfg = parser.parse_args(argv)
    world_size = planned_world_size(cfg)
    validate_common(cfg, world_size, dp_size=world_size)  # HSDP too: every rank has its own data
    validate_fsdp(cfg, world_size)
    plan_or_refuse(cfg, plan_layout(cfg, world_size), world_size)
    return cfg


def plan_layout(cfg, world_size):
    """What each rank holds under --strategy, for --plan and the fit check (labkit/plan.py)."""
    shards = world_size // cfg.hsdp if cfg.hsdp else world_size
    fsdp = cfg.strategy == "fsdp"
    mesh = (f"dp_replicate={cfg.hsdp}, dp_shard={shards}" if cfg.hsdp else f"dp={world_size}")
    what = {"fsdp": "fully_shard, one unit per block" + (" (HSDP)" if cfg.hsdp else ""),
            "ddp": "DDP: a full replica per rank",
            "zero1": "DDP + ZeroRedundancyOptimizer: optimizer state sharded"}[cfg.strategy]
    precision = ("MixedPrecisionPolicy: params gathered in the compute dtype, grads reduced in "
                 "fp32, fp32 master shards" if fsdp else "autocast over fp32 weights")
    return {"mesh": mesh, "what": what, "precision": precision,
            "state_shards": shards if fsdp else 1,
            "optimizer_shards": shards if fsdp else world_size if cfg.strategy == "zero1" else 1,
            "tp": 1, "layers": cfg.num_layers, "in_flight": 1,
            "micro_batch": cfg.batch_size // (world_size * cfg.grad_accum),
            "fsdp": fsdp, "reshard_after_forward": cfg.reshard_after_forward == "true",
            "ddp_buckets": not fsdp}


def fsdp_param_dtype(cfg, device_type):
    """The dtype FSDP gathers params in (None: fp32). auto follows --amp: on CUDA that is bf16,
    and it matters, because autocast over fp32 shards still all-gathers fp32 (twice the bytes)."""
    if cfg.mixed_precision == "auto":
        return compute_dtype(cfg, device_type)
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.mixed_precision]


def validate_fsdp(cfg, world_size):
    if cfg.strategy != "fsdp":
        for flag, used in [("--hsdp", cfg.hsdp), ("--cpu-offload", cfg.cpu_offload),
                           ("--mixed-precision", cfg.mixed_precision not in ("auto", "fp32")),
                           ("--reshard-after-forward", cfg.reshard_after_forward != "true")]:
            if used:
                fail_config(flag, f"applies to --strategy fsdp only, not {cfg.strategy}")
    if cfg.hsdp < 0 or (cfg.hsdp and world_size % cfg.hsdp):
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        fail_config("--hsdp", f"{cfg.hsdp} must divide the world size {world_size}; "
                    f"allowed: 0 (off) or {', '.join(map(str, divisors))}")
    if cfg.mixed_precision in ("bf16", "fp16") and cfg.check_parity:
        fail_config("--check-parity", f"needs --mixed-precision fp32: {cfg.mixed_precision} "
                    "rounding is far above 1e-5")
    if cfg.strategy == "zero1" and cfg.checkpoint_dir:
        fail_config("--checkpoint-dir", "not supported with --strategy zero1 in this lab "
                    "(ZeroRedundancyOptimizer state must be consolidated to one rank first)")


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


def build_fsdp_model(cfg, mesh, device):
    with torch.device("meta"):  # shapes only: no rank allocates the full model
        model = build_model(cfg)
    apply_block_options(model, cfg)  # labkit: --activation-checkpointing, --compile
    apply_fsdp(model, mesh, cfg, device)
    # Allocate only the local shards, then fill them.
    model.to_empty(device="cpu" if cfg.cpu_offload else device)
    init_sharded_weights(model, cfg.seed)
    return model


def build_replicated_model(cfg, device):
    """The baselines: every rank holds the whole model (DDP all-reduces gradients)."""
    model = build_model(cfg).to(device)
    model.init_weights(cfg.seed)
    apply_block_options(model, cfg)  # labkit: --activation-checkpointing, --compile
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
    by torch.chunk (ceil(rows / ranks) each; the trailing ranks fewer, or none)."""
    expected = (Replicate(), Shard(0)) if cfg.hsdp else (Shard(0),)
    shard_size, shard_rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh == mesh, name
        assert tuple(param.placements) == expected, (name, param.placements)
        rows = math.ceil(param.shape[0] / shard_size)
        local_rows = max(0, min(rows, param.shape[0] - rows * shard_rank))
        assert param.to_local().shape == (local_rows, *param.shape[1:]), name


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


def checkpoint_state(cfg, model, optimizer, step, rank):
    # Sharded state dicts: each rank contributes its DTensor shards; DCP records the global
    # layout, so a different world size can load them (it reads only the slices it needs).
    model_state, optim_state = get_state_dict(model, optimizer)
    device = next(model.parameters()).device
    return {"model": model_state, "optim": optim_state, "step": step,
            "data": {"samples_seen": step * cfg.batch_size},
            f"rng_rank{rank}": rng_state(device)}  # labkit: the CPU and the device generator


def save_checkpoint(cfg, model, optimizer, step, rank):
    # A collective: every rank writes its own shards (labkit: tmp dir, then rename).
    save_dcp_atomically(cfg, checkpoint_state(cfg, model, optimizer, step, rank), step, rank)


def load_checkpoint(cfg, model, optimizer, rank):
    """Resume from the newest complete checkpoint, at any world size. Returns the data
    position as a step count (samples seen / global batch)."""
    path = latest_checkpoint(cfg.checkpoint_dir)
    if path is None:
        return 0
    state = checkpoint_state(cfg, model, optimizer, 0, rank)
    # DCP names a nested entry by its dotted path (rng_rank0.cpu). More ranks than the run that
    # saved: reuse rank 0's generators; saved on CPU, resumed on CUDA: only the CPU one.
    saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    generators = state.pop(f"rng_rank{rank}")
    rng_key = f"rng_rank{rank}" if f"rng_rank{rank}.cpu" in saved_keys else "rng_rank0"
    state[rng_key] = {k: v for k, v in generators.items() if f"{rng_key}.{k}" in saved_keys}
    dcp.load(state, checkpoint_id=path)  # reads this rank's slices, resharding as needed
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    restore_rng_state(state[rng_key], next(model.parameters()).device)
    samples = state["data"]["samples_seen"]
    if samples % cfg.batch_size:
        raise ValueError(f"checkpoint saw {samples} samples, not a multiple of --batch-size "
                         f"{cfg.batch_size}; resume with the batch size it was trained with")
    if rank == 0:
        print(f"resumed from {path} at step {state['step']} ({samples} samples seen)", flush=True)
    return state["step"]


def build(cfg, world_size, device):
    """Model, optimizer and mesh (None for the replicated baselines) for --strategy."""
    if cfg.strategy != "fsdp":
        model = build_replicated_model(cfg, device)
        return model, build_optimizer(cfg, model), None
    mesh = build_mesh(cfg, device, world_size)
    model = build_fsdp_model(cfg, mesh, device)
    return model, build_optimizer(cfg, model), mesh


def train(cfg, rank, world_size, device):
    torch.manual_seed(cfg.seed)
    model, optimizer, mesh = build(cfg, world_size, device)
    if mesh:
        inspect_fsdp(model, mesh, cfg)
    start_step = load_checkpoint(cfg, model, optimizer, rank) if cfg.checkpoint_dir else 0
    # After the load: get_state_dict() runs a fake optimizer step to create the state it loads.
    probe = FirstStepBytes(model, optimizer)  # labkit/probes.py: bytes held, from hooks
    # --amp is autocast (as in lab01); --mixed-precision is FSDP's own policy, which is what
    # halves the all-gathers. With bf16 params autocast adds little: the matmuls already run
    # in bf16.
    amp_dtype = compute_dtype(cfg, device.type)
    param_dtype = fsdp_param_dtype(cfg, device.type) if cfg.strategy == "fsdp" else None
    scaler = make_grad_scaler(torch.float16 if torch.float16 in (amp_dtype, param_dtype)
                              else None, device)
    batches = micro_batches(cfg, rank, world_size, start_step, pin_memory=device.type == "cuda")
    announce(cfg, rank, world_size, device, start_step, cfg.strategy,
             f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh else '-'}",
             f"autocast {precision_name(amp_dtype)}, FSDP params {precision_name(param_dtype)}",
             f"{sum(p.numel() for p in model.parameters()):,} params")
    log = train_loop(
        cfg, rank, device, start_step, [optimizer],
        lambda step: train_step(model, optimizer, scaler, batches, cfg, device, amp_dtype,
                                gradient_sync),
        lambda step: save_checkpoint(cfg, model, optimizer, step, rank), loss_divisor=world_size)
    return model, mesh, log, probe, {"autocast": precision_name(amp_dtype),
                                     "fsdp_params": precision_name(param_dtype)}


def run(cfg, rank, world_size, device, wall_start):
    """Train, export, report (and check parity). Every model, and any DDP reducer, lives and
    dies in here, before the process group goes."""
    model, mesh, log, probe, precision = train(cfg, rank, world_size, device)
    # labkit/checkpoint.py: every parameter in full on rank 0 (a collective), gathered at most
    # once, for --export now and --check-parity later
    full_state = full_state_once(cfg, model, rank)
    extra = {"strategy": cfg.strategy, "precision": precision,
             "num_params": sum(p.numel() for p in model.parameters()),
             "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh else None,
             "param_shapes": {n: list(p.shape) for n, p in model.named_parameters()},
             "layout": layout_report(model) if mesh else None,  # collectives: every rank
             **probe.report(world_size)}
    finish_run(cfg, rank, world_size, device, log, compute_dtype(cfg, device.type), wall_start,
               full_state=full_state, extra=extra)


def main(argv=None):
    launch(parse_config(argv), run)  # labkit/runtime.py: init, run, and teardown in finally


if __name__ == "__main__":
    main()
