"""Lab 04: pipeline parallelism, every schedule, with a measured timeline.

What it teaches: the model is cut by layer index into stages; each rank runs its stages and
passes activations forward and gradients backward with point-to-point send/recv only (no
collective touches the model). A batch is split into microbatches so stages work at the same
time; the idle time at the start and end of each step is the bubble. `--schedule` picks any
schedule `torch.distributed.pipelining` offers (SCHEDULES in the kit; the lab rejects what the
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
This file is pipelining, in the order it happens: the schedules, each stage built from its
slice of layers, the ("pp", "dp") mesh, PipelineStage and the schedule, and the run. What it
shares with lab05 is in labkit/pipeline.py: the schedule classes' rules, the cut by layer
index, the step (inputs to the first stage, targets to the last), the clip across stages,
per-stage precision and checkpoints keyed by whole-model names. labkit/ also holds the rest
once (flags, model, data, the loop, metrics, --plan, the timeline probe, the parity reference).

Use it in your project:
  - Replace: `build_model()`, keeping what `build_stage_module()` relies on: blocks in a dict
    keyed by index (names stay the whole model's) and a forward that skips a None embedding,
    norm or output; `loss_fn()` (the schedule calls it per microbatch, on the last stage
    only); `SyntheticSequences`.
  - Keep: `stage_ids_for_rank()`; the ("pp", "dp") mesh of `build_pipeline()` (stages across
    nodes, sends on "pp" only); labkit/pipeline.py's `train_step()` (the loss left on the
    device until a sync point), `clip_grad_norm()` across stages, and checkpoints keyed by
    whole-model names (`save_stages()`: any pp or dp).
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
from torch.distributed.pipelining import PipelineStage

from labkit.data import micro_batches
from labkit.errors import fail_config
from labkit.flags import apply_model_preset, make_parser, planned_world_size, validate_common
from labkit.loop import announce, train_loop
from labkit.metrics import finish_run
from labkit.model import build_model, parameter_shapes
from labkit.parity import FirstStepGrads, check_pipeline_parity
from labkit.pipeline import (SCHEDULES, apply_fsdp_to_stage, apply_stage_autocast,
                             batch_defaults, build_schedule, check_stage_layout, cut_stage,
                             load_stages, pipeline_grad_scaler, save_stages, scaled_loss,
                             train_step, validate_microbatches, validate_stages)
from labkit.plan import plan_or_refuse
from labkit.runtime import compute_dtype, init_mesh, launch, precision_name
from labkit.timeline import Timeline, accumulation_order, timeline_metrics

LAB_NAME = "lab04_pipeline"


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
    batch_defaults(cfg)  # labkit: a dp replica's batch holds --microbatches
    world_size = planned_world_size(cfg)
    apply_model_preset(cfg)  # validate_pipeline cuts the model's layers into stages
    validate_pipeline(cfg, world_size)
    validate_common(cfg, world_size, dp_size=cfg.dp)
    validate_microbatches(cfg, SCHEDULES[cfg.schedule], world_size // cfg.dp)
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
            "fsdp": cfg.dp > 1, "keeps_gathered": True, "ddp_buckets": False}


def validate_pipeline(cfg, world_size):
    """The dp x pp split of the world, then the schedule class's own rules (labkit)."""
    if cfg.dp <= 0:
        fail_config("--dp", f"must be > 0, got {cfg.dp}")
    if world_size % cfg.dp:
        fail_config("--dp", f"{cfg.dp} does not divide world size {world_size}")
    pp_size = world_size // cfg.dp
    if pp_size < 2:
        fail_config("--dp", f"leaves a pipeline of {pp_size} rank (world size {world_size} / "
                    f"dp {cfg.dp}); run under torchrun with --nproc-per-node >= 2 x --dp")
    validate_stages(cfg, SCHEDULES[cfg.schedule], pp_size)


# The point of the lab: place the stages on ranks, cut the model, run the pipeline.
def stage_ids_for_rank(pp_rank, pp_size, cfg):
    """The stages this rank runs, in the order the schedule expects them."""
    if SCHEDULES[cfg.schedule]["placement"] == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(cfg.stages_per_rank)]


def build_stage_module(cfg, stage_id, num_stages, device):
    """The whole model's stage_id-th slice of layers (labkit's cut_stage: names stay those of
    the whole model, so initial_value gives the weights the single-process reference has, and
    checkpoint keys do not depend on how the model was cut)."""
    with torch.device("meta"):  # no memory for layers this stage drops
        module = cut_stage(build_model(cfg), stage_id, num_stages)
    module.to_empty(device=device)
    module.init_weights(cfg.seed)
    return module


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
        modules = [apply_fsdp_to_stage(m, mesh["dp"], amp_dtype) for m in modules]
    check_stage_layout(modules, stage_ids, num_stages, cfg, device)  # labkit/pipeline.py
    # Sends and receives go over the pp sub-group only: the neighbours in this pipeline.
    stages = [PipelineStage(m, s, num_stages, device, group=mesh["pp"].get_group())
              for m, s in zip(modules, stage_ids)]
    for stage in stages:
        apply_stage_autocast(stage, device, amp_dtype)
    schedule = build_schedule(cfg, stages, loss)  # labkit/pipeline.py
    optimizers = [torch.optim.AdamW(m.parameters(), lr=cfg.lr) for m in modules]
    return mesh, stages, schedule, optimizers


def train(cfg, rank, world_size, device):
    amp_dtype = compute_dtype(cfg, device.type)
    scaler = pipeline_grad_scaler(amp_dtype, device)
    timeline = Timeline(cfg, device)  # labkit/timeline.py: --timeline (its loss counts bytes)
    mesh, stages, schedule, optimizers = build_pipeline(cfg, device, amp_dtype,
                                                        timeline.counted(scaled_loss(scaler)))
    timeline.attach(stages, schedule)
    modules = [s.submod for s in stages]
    start_step = load_stages(cfg, modules, optimizers, rank)  # labkit/pipeline.py: DCP
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
                     lambda step: save_stages(cfg, modules, optimizers, step, rank),
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
               own_parity=lambda: check_pipeline_parity(
                   cfg, stages, first_grads.values, log.losses,
                   accumulation_order(timeline, stages, cfg.microbatches)))


def main(argv=None):
    launch(parse_config(argv), run)  # labkit/runtime.py: init, run, and teardown in finally


if __name__ == "__main__":
    main()
