"""Lab 04: pipeline parallelism, every schedule, with a measured timeline.

What it teaches: the model is cut by layer index into stages; each rank runs its stages and
passes activations forward and gradients backward with point-to-point send/recv only (no
collective touches the model). A batch is split into microbatches so stages work at the same
time; the idle time at the start and end of each step is the bubble. `--schedule` picks any
schedule `torch.distributed.pipelining` offers (SCHEDULES below; the lab rejects what the
class cannot run). The run records when every forward / backward (input and weight, where the
schedule splits them) ran on every rank, measures the bubble and counts the activation bytes
each rank keeps for backward (labkit/timeline.py). `--check-parity` retrains in one process on
the same batches: the loss, the first step's gradients and the final parameters
must match within 1e-5 (fp32 on CPU). `--dp N` runs N pipelines side by side, each stage
sharded with FSDP over the "dp" axis of a ("pp", "dp") mesh (pp outermost: across nodes).

Launch (the same file everywhere; the backend follows the hardware):
    torchrun --nproc-per-node 2 labs/lab04_pipeline.py --check-parity        # 1F1B, 2 stages
    torchrun --nproc-per-node 2 labs/lab04_pipeline.py --schedule Interleaved1F1B \\
        --stages-per-rank 2 --microbatches 4 --check-parity                   # 4 stages on 2 ranks
    torchrun --nproc-per-node 4 labs/lab04_pipeline.py --dp 2 --check-parity  # 2 x 2-stage pipes
    torchrun --nproc-per-node 8 labs/lab04_pipeline.py --num-layers 8 \\
        --microbatches 16 --batch-size 64                                     # one node, 8 GPUs
    # two nodes (run on each; same --rdzv-id everywhere, node 0's address as the endpoint;
    # --checkpoint-dir must be on a filesystem every node sees):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29400 --rdzv-id $JOB_ID labs/lab04_pipeline.py \\
        --num-layers 16 --microbatches 32 --batch-size 64

Minimum world size: 2 (a pipeline of one rank has nothing to send; plain `python` says so and
exits 2). Expected last line (first command above; numbers vary slightly with hardware):
    done | lab04_pipeline | gloo x2 | 40 steps | loss 0.47... | parity 3.8e-07 | ...
Lesson: lessons/04_pipeline.py. Runbooks: runbooks/collective-timeout.md, stuck-rank.md,
oom-mitigations.md.

Copy it: this file and the folder labkit/ beside it (torch and the standard library only).
This file is pipelining, in the order it happens: the schedules, the stages cut by layer
index, the ("pp", "dp") mesh, PipelineStage and the schedule, the step, the clip across stages
and checkpoints keyed by whole-model names. labkit/ holds the rest once (flags, model, data,
the loop, metrics, --plan, the timeline probe, the parity reference).

Use it in your project:
  - Replace: `build_model()`, keeping what `build_stage_module()` relies on: blocks in a dict
    keyed by index (names stay the whole model's) and a forward that skips a None embedding,
    norm or output; `loss_fn()` (the schedule calls it per microbatch, on the last stage
    only); `SyntheticSequences`.
  - Keep: `stage_ids_for_rank()`; the ("pp", "dp") mesh of `build_pipeline()` (stages across
    nodes, sends on "pp" only); `train_step()`: inputs to the first stage, target and losses
    to the last, the loss left on the device until a sync point; `clip_grad_norm()` across
    stages; checkpoints keyed by whole-model names (any pp or dp).
  - Pitfalls: stages split `--num-layers` evenly, but the first and last also hold embedding
    and output: balance by cost. Bubble (pp-1)/(m+pp-1) for GPipe and 1F1B (labkit/timeline.py's
    `bubble_formula()`): more `--microbatches` shrink it, but GPipe keeps all m in memory
    (runbooks/oom-mitigations.md). Shapes are inferred at the first step: pad to a fixed
    length. A rank that skips a step leaves its neighbours waiting (runbooks/stuck-rank.md).
"""

import datetime
import math
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.pipelining as pipelining
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from labkit.checkpoint import latest_checkpoint, save_dcp_atomically
from labkit.data import micro_batches
from labkit.errors import fail_config
from labkit.flags import apply_model_preset, make_parser, planned_world_size, validate_common
from labkit.loop import announce, train_loop
from labkit.metrics import finish_run
from labkit.model import MODEL_PRESETS, build_model, loss_fn, parameter_shapes
from labkit.parity import FirstStepGrads, check_pipeline_parity
from labkit.plan import plan_or_refuse
from labkit.probes import check_stage_layout
from labkit.runtime import compute_dtype, init_mesh, launch, precision_name
from labkit.timeline import Timeline, timeline_metrics

LAB_NAME = "lab04_pipeline"


# Every schedule in torch.distributed.pipelining, named as its class without "Schedule".
# placement: "loop" puts stage s on rank s % pp (stages 0..pp-1 on ranks 0..pp-1, then again);
#   "v" puts rank r's two stages at r and 2pp-1-r, so the first and last stages share rank 0
#   and the turn of the V (stages pp-1, pp) stays on one rank without a send.
# stages_per_rank: fixed by the schedule, or None when --stages-per-rank V chooses it.
# microbatches: what the class constructor demands of m (it raises ValueError otherwise):
#   "any"; "per_stage": m >= number of stages; "rounds": m runs in max(1, m // pp) rounds and
#   must divide evenly into them (pp=2: m=5 fails, m=4 or 6 work).
# since: the first torch release that ships the class (older ones get a one-line error).
SCHEDULES = {
    # Fill all forwards, then drain all backwards: m microbatches of activations held at once.
    "GPipe": dict(placement="loop", stages_per_rank=1, microbatches="any", since="2.4"),
    # Warm up with pp - rank forwards, then alternate: at most pp - rank microbatches in flight.
    "1F1B": dict(placement="loop", stages_per_rank=1, microbatches="per_stage", since="2.4"),
    # Megatron's interleaving: V stages per rank cut the bubble by V, for V x more sends.
    "Interleaved1F1B": dict(placement="loop", stages_per_rank=None, microbatches="rounds",
                            since="2.4"),
    # Breadth-first: all microbatches through a rank's first stage before its next stage.
    "LoopedBFS": dict(placement="loop", stages_per_rank=None, microbatches="any", since="2.4"),
    # Zero bubble (ZB-H1 shape, interleaved): backward split into input-grad (I), which the
    # previous stage is waiting for, and weight-grad (W), which fills the idle slots later.
    "InterleavedZeroBubble": dict(placement="loop", stages_per_rank=None,
                                  microbatches="rounds", since="2.5"),
    # Zero bubble in a V; the class raises unless exactly 2 stages per rank.
    "ZBVZeroBubble": dict(placement="v", stages_per_rank=2, microbatches="any", since="2.6"),
    # DeepSeek's DualPipe cut in half (a V). The F/B overlap it schedules runs one after the
    # other in this implementation.
    "DualPipeV": dict(placement="v", stages_per_rank=2, microbatches="per_stage", since="2.9"),
}


def schedule_class(name):
    """The schedule class, or None when the installed torch predates it."""
    return getattr(pipelining, f"Schedule{name}", None)


def parse_config(argv=None):
    parser = make_parser(LAB_NAME, __doc__, timeline=True)
    arg = parser.add_argument
    arg("--schedule", choices=list(SCHEDULES), default="1F1B",
        help="pipeline schedule (the torch class name without 'Schedule')")
    arg("--microbatches", type=int, default=4,
        help="microbatches per optimizer step; each dp replica splits its batch into this many")
    arg("--stages-per-rank", type=int, default=0,
        help="stages (model chunks) per rank; 0 = what the schedule needs (1, or 2 for the "
             "interleaved and V schedules)")
    arg("--dp", type=int, default=1,
        help="data-parallel degree; world size = dp x pp, each stage sharded with FSDP over dp")
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
    validate_pipeline(cfg, world_size)
    validate_common(cfg, world_size, dp_size=cfg.dp)
    validate_microbatches(cfg, world_size)
    plan_or_refuse(cfg, plan_layout(cfg, world_size), world_size)
    return cfg


def plan_layout(cfg, world_size):
    """What the busiest rank (the first stage: most microbatches in flight) holds."""
    pp_size = world_size // cfg.dp
    num_stages = pp_size * cfg.stages_per_rank
    # Microbatches whose activations the first stage holds at once: all of them when every
    # forward runs before the backwards (GPipe, LoopedBFS), else up to one per stage.
    breadth_first = cfg.schedule in ("GPipe", "LoopedBFS")
    in_flight = cfg.microbatches if breadth_first else min(cfg.microbatches, num_stages)
    return {"mesh": f"pp={pp_size}, dp={cfg.dp}",
            "what": f"{cfg.schedule}, {cfg.stages_per_rank} stage(s) of "
                    f"{cfg.num_layers // num_stages} block(s) per rank"
                    + (", each fully_shard over dp" if cfg.dp > 1 else ""),
            "precision": "autocast in every stage" + (
                "; MixedPrecisionPolicy over dp: params gathered in the compute dtype, grads "
                "reduced in fp32" if cfg.dp > 1 else "; fp32 weights and gradients"),
            "state_shards": cfg.dp, "optimizer_shards": cfg.dp, "tp": 1,
            "layers": cfg.stages_per_rank * cfg.num_layers // num_stages,
            "in_flight": in_flight,
            "micro_batch": cfg.batch_size // (cfg.dp * cfg.microbatches),
            "fsdp": cfg.dp > 1, "ddp_buckets": False}


def validate_pipeline(cfg, world_size):
    """Reject what the schedule classes would reject, before any process exists to hang."""
    spec = SCHEDULES[cfg.schedule]
    if schedule_class(cfg.schedule) is None:
        fail_config("--schedule", f"{cfg.schedule} needs torch >= {spec['since']}, "
                    f"this is {torch.__version__}")
    if cfg.grad_accum != 1:
        fail_config("--grad-accum", "must be 1: pipeline microbatches already accumulate "
                    "gradients; use --microbatches")
    for flag in ("microbatches", "dp"):
        if getattr(cfg, flag) <= 0:
            fail_config(f"--{flag}", f"must be > 0, got {getattr(cfg, flag)}")
    if world_size % cfg.dp:
        fail_config("--dp", f"{cfg.dp} does not divide world size {world_size}")
    pp_size = world_size // cfg.dp
    if pp_size < 2:
        fail_config("--dp", f"leaves a pipeline of {pp_size} rank (world size {world_size} / "
                    f"dp {cfg.dp}); run under torchrun with --nproc-per-node >= 2 x --dp")
    fixed = spec["stages_per_rank"]
    if cfg.stages_per_rank == 0:
        cfg.stages_per_rank = fixed or 2
    elif fixed and cfg.stages_per_rank != fixed:
        fail_config("--stages-per-rank", f"{cfg.schedule} runs exactly {fixed} stage(s) per "
                    f"rank, got {cfg.stages_per_rank}")
    num_stages = pp_size * cfg.stages_per_rank
    if cfg.num_layers == 0:  # debug's default: the smallest multiple of the stages >= 4
        cfg.num_layers = num_stages * math.ceil(4 / num_stages)
    if cfg.num_layers % num_stages:
        fail_config("--num-layers", f"{cfg.num_layers} must split evenly into pp x "
                    f"stages-per-rank = {pp_size} x {cfg.stages_per_rank} = {num_stages} stages")


def validate_microbatches(cfg, world_size):
    """Refuse the microbatch counts that the schedule class would refuse (with a ValueError)."""
    pp_size, m = world_size // cfg.dp, cfg.microbatches
    num_stages, rounds = pp_size * cfg.stages_per_rank, max(1, m // pp_size)
    rule = SCHEDULES[cfg.schedule]["microbatches"]
    where = f"{cfg.schedule} with {num_stages} stages on {pp_size} ranks"
    if cfg.batch_size % (cfg.dp * m):
        fail_config("--microbatches", f"--batch-size {cfg.batch_size} must split into --dp x "
                    f"--microbatches = {cfg.dp} x {m} equal microbatches")
    if rule == "per_stage" and m < num_stages:
        fail_config("--microbatches", f"{where} needs >= {num_stages} (one per stage), got {m}")
    if rule == "rounds" and m % rounds:
        fail_config("--microbatches", f"{where} runs in max(1, m // pp) = {rounds} rounds, "
                    f"and {m} does not divide by {rounds}")


def stage_ids_for_rank(pp_rank, pp_size, cfg):
    """The stages this rank runs, in the order the schedule expects them."""
    if SCHEDULES[cfg.schedule]["placement"] == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(cfg.stages_per_rank)]


def build_stage_module(cfg, stage_id, num_stages, device):
    """The whole model's stage_id-th slice of layers. Names stay those of the whole model
    (layers.5.attention.wq.weight), so initial_value gives the weights the single-process
    reference has, and checkpoint keys do not depend on how the model was cut."""
    with torch.device("meta"):  # no memory for layers this stage drops
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
    module.to_empty(device=device)
    module.init_weights(cfg.seed)
    return module


def apply_fsdp(module, dp_mesh, low_dtype):
    """Shard one stage over the dp axis: all-gather before compute, reduce-scatter of the
    gradients once per step (the schedule holds the sync back until the last microbatch)."""
    # reshard_after_forward=False: with True, each of the m microbatch forwards would
    # all-gather the stage's parameters again; here they stay unsharded for the whole step.
    # Low precision (bf16 on CUDA by default): gathered and used in it, reduced in fp32.
    mp_policy = (MixedPrecisionPolicy(param_dtype=low_dtype, reduce_dtype=torch.float32)
                 if low_dtype is not None else MixedPrecisionPolicy())
    for block in module.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)
    return module


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


def build_pipeline(cfg, device, amp_dtype, loss):
    """Mesh, stages, schedule and one optimizer per stage module for this rank."""
    world_size = dist.get_world_size()
    pp_size = world_size // cfg.dp
    # "pp" outermost, as in torchtitan: rank = pp_rank * dp + dp_rank, so on a multi-node job
    # the stages go across nodes (one activation per microbatch per cut: the lightest traffic)
    # and each dp group, which all-gathers and reduce-scatters every stage's weights, sits on
    # neighbouring ranks inside a node.
    mesh = init_mesh(device.type, (pp_size, cfg.dp), ("pp", "dp"),
                     datetime.timedelta(seconds=cfg.timeout_s))
    pp_rank = mesh.get_local_rank("pp")
    num_stages = pp_size * cfg.stages_per_rank
    stage_ids = stage_ids_for_rank(pp_rank, pp_size, cfg)
    modules = [build_stage_module(cfg, s, num_stages, device) for s in stage_ids]
    if cfg.dp > 1:
        modules = [apply_fsdp(m, mesh["dp"], amp_dtype) for m in modules]
    check_stage_layout(modules, stage_ids, num_stages, cfg, device)  # labkit/probes.py
    # Sends and receives go over the pp sub-group only: the neighbours in this pipeline.
    stages = [PipelineStage(m, s, num_stages, device, group=mesh["pp"].get_group())
              for m, s in zip(modules, stage_ids)]
    for stage in stages:
        apply_stage_autocast(stage, device, amp_dtype)
    schedule_cls = schedule_class(cfg.schedule)
    # loss_fn is the mean over one microbatch; scale_grads (default) divides the summed
    # gradients by the number of microbatches, so they are the gradient of the batch mean.
    one_stage = SCHEDULES[cfg.schedule]["stages_per_rank"] == 1  # takes a stage, not a list
    schedule = schedule_cls(stages[0] if one_stage else stages, n_microbatches=cfg.microbatches,
                            loss_fn=loss)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=cfg.lr) for m in modules]
    return mesh, stages, schedule, optimizers


def clip_grad_norm(modules, max_norm, device):
    """clip_grad_norm_ over the whole model: each rank holds a disjoint piece of the gradients
    (its stages, and with FSDP its shard), so the squared norms add up with one all-reduce."""
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    norms = [torch.linalg.vector_norm(g) for g in local] or [torch.zeros((), device=device)]
    total_sq = torch.linalg.vector_norm(torch.stack(norms)).pow(2).reshape(1)
    dist.all_reduce(total_sq)
    total_norm = total_sq.sqrt()
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # as clip_grad_norm_ does
    for g in local:
        g.mul_(coef)
    return total_norm


def train_step(cfg, schedule, stages, optimizers, scaler, batch, device):
    """One optimizer step: the schedule runs forward and backward of every microbatch."""
    inputs, targets = (t.to(device, non_blocking=True) for t in batch)
    holds_first = any(s.is_first for s in stages)
    holds_last = any(s.is_last for s in stages)
    losses = []  # filled with one loss per microbatch on the rank holding the last stage
    args = (inputs,) if holds_first else ()
    kwargs = {"target": targets, "losses": losses} if holds_last else {}
    schedule.step(*args, **kwargs)
    modules = [s.submod for s in stages]
    if not holds_last:
        scaler.scale(torch.zeros((), device=device))  # scale() creates the scale on first use
    for optimizer in optimizers:
        scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
    if cfg.clip:
        clip_grad_norm(modules, cfg.clip, device)
    # The recorded losses are scaled (fp16); get_scale() is 1.0 when the scaler is disabled.
    loss = (torch.stack(losses).mean() / scaler.get_scale() if holds_last
            else torch.zeros((), device=device))
    for optimizer in optimizers:
        scaler.step(optimizer)  # skipped on every rank if any stage's fp16 grads overflowed
        optimizer.zero_grad(set_to_none=True)
    scaler.update()
    # Only last-stage ranks know the loss: StepLog's sum over all ranks / dp is the batch mean.
    return loss.detach().reshape(1)


def pipeline_grad_scaler(dtype, device):
    """make_grad_scaler for a pipeline: each rank holds different parameters, so one stage's
    overflow must make every stage skip the step. ShardedGradScaler (public, in
    torch.distributed.fsdp) all-reduces the inf check over the group, here the whole world;
    torch.amp.GradScaler would check this rank's stages only."""
    return ShardedGradScaler(device.type, enabled=dtype == torch.float16,
                             process_group=dist.group.WORLD)


# Checkpoints: one DCP checkpoint for the whole pipeline. Every rank writes its own stages'
# tensors (and with FSDP its shards) under the whole model's names, so the files do not
# depend on pp, dp or the schedule.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # keys per parameter


def pipeline_state(modules, optimizers):
    """Per stage module: its model and optimizer state dicts, plus all of them merged."""
    parts = [(get_model_state_dict(m), get_optimizer_state_dict(m, o, options=OPTIM_OPTIONS))
             for m, o in zip(modules, optimizers)]
    merged = {"model": {k: v for part, _ in parts for k, v in part.items()},
              "optim": {k: v for _, part in parts for k, v in part.items()}}
    return parts, merged


def save_checkpoint(cfg, modules, optimizers, step, rank):
    save_dcp_atomically(cfg, pipeline_state(modules, optimizers)[1], step, rank)


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


def train(cfg, rank, world_size, device):
    amp_dtype = compute_dtype(cfg, device.type)
    scaler = pipeline_grad_scaler(amp_dtype, device)
    timeline = Timeline(cfg, device)  # labkit/timeline.py: --timeline (its loss counts bytes)
    mesh, stages, schedule, optimizers = build_pipeline(cfg, device, amp_dtype,
                                                        timeline.counted(scaled_loss(scaler)))
    timeline.attach(stages, schedule)
    modules = [s.submod for s in stages]
    start_step = load_checkpoint(cfg, modules, optimizers, rank)
    first_grads = FirstStepGrads(cfg, stages, schedule, start_step)  # labkit/parity.py
    batches = micro_batches(cfg, mesh.get_local_rank("dp"), cfg.dp, start_step,
                            pin_memory=device.type == "cuda")
    announce(cfg, rank, world_size, device, start_step, precision_name(amp_dtype),
             f"{sum(math.prod(s) for s in parameter_shapes(cfg).values()):,} params",
             cfg.schedule, f"dp {cfg.dp} x pp {world_size // cfg.dp} x {cfg.stages_per_rank} "
             f"stage(s) per rank", f"{cfg.microbatches} microbatches")

    def step_fn(step):
        t0 = time.perf_counter()
        batch = next(batches)
        data_s = time.perf_counter() - t0
        return train_step(cfg, schedule, stages, optimizers, scaler, batch, device), data_s

    # Only last-stage ranks hold a loss: the log's sum over all ranks / dp is the batch mean.
    log = train_loop(cfg, rank, device, start_step, optimizers, step_fn,
                     lambda step: save_checkpoint(cfg, modules, optimizers, step, rank),
                     loss_divisor=cfg.dp)
    return stages, log, timeline, first_grads


def run(cfg, rank, world_size, device, wall_start):
    """Train, report and check parity. Every model lives and dies in here."""
    stages, log, timeline, first_grads = train(cfg, rank, world_size, device)
    amp_dtype = compute_dtype(cfg, device.type)
    extra = {"schedule": cfg.schedule, "pp_size": world_size // cfg.dp, "dp_size": cfg.dp,
             "stages_per_rank": cfg.stages_per_rank, "num_microbatches": cfg.microbatches,
             "precision": precision_name(amp_dtype),
             **timeline_metrics(cfg, timeline, stages, world_size)}  # a collective
    # Every rank checks the layers it holds against the single-process reference.
    finish_run(cfg, rank, world_size, device, log, amp_dtype, wall_start, extra=extra,
               own_parity=lambda: check_pipeline_parity(cfg, stages, first_grads.values,
                                                        log.losses, timeline))


def main(argv=None):
    launch(parse_config(argv), run)  # labkit/runtime.py: init, run, and teardown in finally


if __name__ == "__main__":
    main()
