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
--activation-checkpointing recomputes each block in backward: a 70B stage needs it (--plan).
Expected last line (first command above; numbers vary slightly with hardware):
    done | lab05_3d | gloo x8 | 20 steps | loss 1.27... | parity 1.4e-06 | ...
Lesson: lessons/05_3d.py. Runbooks: runbooks/collective-timeout.md, stuck-rank.md,
oom-mitigations.md.

Copy it: this file and the folder labkit/ beside it (torch and the standard library only).
This file is the composition, in the order it happens: the layout and its checks, the
("pp", "dp", "tp") mesh, the TP plan, each stage cut, then TP'd, then FSDP'd, then filled,
what each rank holds, the pipeline over "pp", and the step with its loss counted once per
tp group. labkit/pipeline.py holds what it shares with lab04 (the schedule rules, the cut,
the step, the clip across stages, per-stage precision, checkpoints of stage modules), and
labkit/ the rest once (flags, model, data, the loop, metrics, --plan, the parity reference).

Use it in your project:
  - Replace: `build_model()`, keeping blocks in a dict keyed by index (names stay the whole
    model's) and a forward that skips a None embedding, norm or output; `block_plan()` and
    `root_plan()` for other layer names; `loss_fn()`; `SyntheticSequences`.
  - Keep: the order in `build_stage_module()` (cut, TP, FSDP, then materialise); `init_mesh()`
    (every axis gets the job's timeout); `clip_grad_norm()` with `counted_once()`: each
    gradient element once over all three axes; checkpoints keyed by whole-model names
    (`save_stages()`: any layout).
  - Pitfalls: "tp" is the innermost axis of `build_mesh()`, so a TP group is --tp consecutive
    ranks: keep it inside one node. --num-heads, --num-kv-heads, --ffn-dim and --vocab-size
    must divide by --tp. Under PP, `apply_fsdp_to_stage()` keeps a stage's weights gathered
    for the whole step (reshard_after_forward=False, as torchtitan does): memory for one
    all-gather per step, not one per microbatch (runbooks/oom-mitigations.md). A rank that
    skips a step leaves its pipeline, TP and FSDP peers waiting (runbooks/stuck-rank.md).
"""

import datetime
import math
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module)

from labkit import pipeline  # what lab04 and lab05 share, named pipeline.* below
from labkit.data import micro_batches
from labkit.errors import fail_config
from labkit.flags import apply_model_preset, make_parser, planned_world_size, validate_common
from labkit.loop import announce, train_loop
from labkit.metrics import finish_run
from labkit.model import (apply_activation_checkpointing, build_model, check_plan_keys,
                          init_sharded_weights, parameter_shapes)
from labkit.parity import FirstStepGrads, check_pipeline_parity
from labkit.plan import plan_or_refuse
from labkit.runtime import compute_dtype, init_mesh, launch, precision_name

LAB_NAME = "lab05_3d"

# The schedules this lab runs, one stage per rank or looped (lab04 runs them all).
SCHEDULES = {name: pipeline.SCHEDULES[name] for name in ("GPipe", "1F1B", "Interleaved1F1B")}


def parse_config(argv=None):
    parser = make_parser(LAB_NAME, __doc__)
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
    arg("--activation-checkpointing", action="store_true",
        help="recompute each block's activations in backward instead of storing them (what a "
             "70B stage needs: see --plan)")
    # 20 steps, not 40: the default run is 8 processes, and on a 2-core laptop it must stay
    # under 30 s (each step costs about 0.5 s there, mostly the oversubscribed collectives).
    parser.set_defaults(steps=20)
    cfg = parser.parse_args(argv)
    pipeline.batch_defaults(cfg)  # a dp replica's batch holds --microbatches
    world_size = planned_world_size(cfg)
    apply_model_preset(cfg)  # validate_stages cuts the model's layers into stages
    validate_layout(cfg, world_size)
    pipeline.validate_stages(cfg, SCHEDULES[cfg.schedule], cfg.pp)
    validate_common(cfg, world_size, dp_size=cfg.dp)
    pipeline.validate_microbatches(cfg, SCHEDULES[cfg.schedule], cfg.pp)
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
            "fsdp": True, "keeps_gathered": True, "sequence_parallel": False,
            "ddp_buckets": False}


# --- the composition: cut into stages, then TP inside each block, then FSDP -----------------
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


# The last stage's root FSDP module returns its logits as a view, and FSDP2 warns (once per
# rank) that an in-place op on such a view would skip its pre-backward hook. Nothing here
# modifies the logits in place: the schedule's loss_fn only reads them. The filter names this
# one message and module, so any other FSDP warning still shows.
warnings.filterwarnings("ignore", category=UserWarning,
                        message=r"FSDP2-wrapped module \(FSDPTinyLlama\) returned a view tensor")


def apply_tp(module, tp_mesh):
    for block in module.layers.values():
        plan = block_plan()
        check_plan_keys(block, plan)  # labkit: a key that matches nothing is an error
        parallelize_module(block, tp_mesh, plan)
    plan = root_plan(module)
    if plan:
        check_plan_keys(module, plan)
        parallelize_module(module, tp_mesh, plan)


def build_stage_module(cfg, stage_id, num_stages, mesh, device, low_dtype):
    """Stage stage_id of the whole model, TP'd over "tp" and sharded over "dp", in that order
    (torchtitan: pipeline_llm() splits the model, then parallelize_fn applies TP, then FSDP,
    to each part). Names stay the whole model's (layers.5.attention.wq.weight), so the
    weights equal the reference's and checkpoint keys do not depend on the layout."""
    with torch.device("meta"):  # no memory for anything before it is sharded
        module = pipeline.cut_stage(build_model(cfg), stage_id, num_stages)
    apply_tp(module, mesh["tp"])
    if cfg.activation_checkpointing:  # torchtitan's order: TP, then checkpointing, then FSDP
        apply_activation_checkpointing(module)  # labkit: each block keeps only its input
    pipeline.apply_fsdp_to_stage(module, mesh["dp"], low_dtype)  # reshard_after_forward=False
    module.to_empty(device=device)
    init_sharded_weights(module, cfg.seed)  # labkit: each shard its slice of the same weights
    return module


def sharded_over_tp(param):
    """True for a TP'd weight (disjoint slices over "tp"); False for the norms, which TP leaves
    whole, so every tp rank holds the same copy (FSDP still shards them over "dp")."""
    return "tp" in (param.device_mesh.mesh_dim_names or ())


def counted_once(tp_rank):
    """For the gradient norm and the layout check: count each element once over all three
    axes, so the norms' tp copies count on tp rank 0 only."""
    return lambda param: sharded_over_tp(param) or tp_rank == 0


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


def build_pipeline(cfg, device, amp_dtype, loss, rank):
    """Mesh, stages, schedule and one optimizer per stage module for this rank."""
    mesh = build_mesh(cfg, device)
    num_stages = cfg.pp * cfg.stages_per_rank
    stage_ids = stage_ids_for_rank(mesh.get_local_rank("pp"), cfg.pp, cfg)
    modules = [build_stage_module(cfg, s, num_stages, mesh, device, amp_dtype)
               for s in stage_ids]
    pipeline.check_stage_layout(modules, stage_ids, num_stages, cfg, device,
                                counted_once(mesh.get_local_rank("tp")))
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
        pipeline.apply_stage_autocast(stage, device, amp_dtype)
    schedule = pipeline.build_schedule(cfg, stages, loss)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=cfg.lr) for m in modules]
    return mesh, stages, schedule, optimizers


def train(cfg, rank, world_size, device):
    amp_dtype = compute_dtype(cfg, device.type)
    scaler = pipeline.pipeline_grad_scaler(amp_dtype, device)  # one overflow verdict for all
    mesh, stages, schedule, optimizers = build_pipeline(cfg, device, amp_dtype,
                                                        pipeline.scaled_loss(scaler), rank)
    modules = [s.submod for s in stages]
    tp_rank = mesh.get_local_rank("tp")
    start_step = pipeline.load_stages(cfg, modules, optimizers, rank)  # DCP, any layout
    first_grads = FirstStepGrads(cfg, stages, schedule, start_step)  # labkit/parity.py
    # Every rank of one dp slot (all its pp stages and tp slices) reads the same batches.
    batches = micro_batches(cfg, mesh.get_local_rank("dp"), cfg.dp, start_step,
                            pin_memory=device.type == "cuda")
    announce(cfg, rank, world_size, device, start_step, precision_name(amp_dtype),
             f"{sum(math.prod(s) for s in parameter_shapes(cfg).values()):,} params",
             cfg.schedule, f"pp {cfg.pp} x dp {cfg.dp} x tp {cfg.tp}",
             f"{cfg.stages_per_rank} stage(s) per pp rank", f"{cfg.microbatches} microbatches")

    def step_fn(step):
        t0 = time.perf_counter()
        batch = next(batches)
        data_s = time.perf_counter() - t0
        # Every tp rank of the last stage has the same loss; tp rank 0 reports it, so the
        # log's sum over all ranks, divided by dp, is the batch mean.
        return pipeline.train_step(cfg, schedule, stages, optimizers, scaler, batch, device,
                                   reports_loss=tp_rank == 0,
                                   counted=counted_once(tp_rank)), data_s

    log = train_loop(cfg, rank, device, start_step, optimizers, step_fn,
                     lambda step: pipeline.save_stages(cfg, modules, optimizers, step, rank),
                     loss_divisor=cfg.dp)
    return mesh, stages, log, first_grads


def run(cfg, rank, world_size, device, wall_start):
    """Train, report and check parity. Every model lives and dies in here."""
    mesh, stages, log, first_grads = train(cfg, rank, world_size, device)
    amp_dtype = compute_dtype(cfg, device.type)
    extra = {"schedule": cfg.schedule, "pp_size": cfg.pp, "dp_size": cfg.dp, "tp_size": cfg.tp,
             "stages_per_rank": cfg.stages_per_rank, "num_microbatches": cfg.microbatches,
             "precision": precision_name(amp_dtype)}
    # full_tensor() gathers each parameter over dp and tp, so the ranks at dp 0, tp 0 (one per
    # pp rank, rank 0 among them) hold their stages whole: they retrain the small reference
    # and compare. GPipe, 1F1B and Interleaved1F1B run backwards in microbatch order.
    compares = mesh.get_local_rank("dp") == 0 and mesh.get_local_rank("tp") == 0
    finish_run(cfg, rank, world_size, device, log, amp_dtype, wall_start, extra=extra,
               own_parity=lambda: check_pipeline_parity(
                   cfg, stages, first_grads.values, log.losses, range(cfg.microbatches),
                   compare=compares))


def main(argv=None):
    launch(parse_config(argv), run)  # labkit/runtime.py: init, run, and teardown in finally


if __name__ == "__main__":
    main()
