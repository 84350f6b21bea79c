"""What the pipeline labs (lab04, and lab05 in 3-D) share besides their own mesh and
stages: the schedule classes' rules, checked before any process group; the stage cut; a
stage's FSDP; precision across stages (autocast per stage, fp16 loss scaling inside the
schedule's loss, one overflow verdict for all stages); the step; the gradient norm across
stages; DCP checkpoints of several stage modules; and the check that the stages hold the
whole model exactly once."""

import math

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.pipelining as pipelining
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from labkit.checkpoint import latest_checkpoint, save_dcp_atomically
from labkit.errors import fail_config
from labkit.model import MODEL_PRESETS, build_model, loss_fn


# --- the schedule classes' rules ----------------------------------------------------------
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


def batch_defaults(cfg):
    """Each dp replica's batch is split into --microbatches: for the debug model 16
    sequences, not 8, and the layers default to the smallest multiple of the stage count >= 4
    (validate_stages() sets them); for a preset, each microbatch is its micro-batch size."""
    if cfg.model == "debug":
        cfg.micro_batch_size = cfg.micro_batch_size or 16
        cfg.num_layers = cfg.num_layers or 0
    elif cfg.micro_batch_size is None:
        cfg.micro_batch_size = MODEL_PRESETS[cfg.model]["micro_batch_size"] * cfg.microbatches


def validate_stages(cfg, spec, pp_size):
    """Reject what the schedule class would reject, before any process exists to hang; fill
    in --stages-per-rank and, for the debug model, --num-layers (the smallest multiple of the
    stage count >= 4)."""
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
    num_stages = pp_size * cfg.stages_per_rank
    if cfg.num_layers == 0:
        cfg.num_layers = num_stages * math.ceil(4 / num_stages)
    if cfg.num_layers % num_stages:
        fail_config("--num-layers", f"{cfg.num_layers} must split evenly into pp x "
                    f"stages-per-rank = {pp_size} x {cfg.stages_per_rank} = {num_stages} stages")


def build_schedule(cfg, stages, loss):
    """The schedule over this rank's stages. loss is the mean over one microbatch;
    scale_grads (default) divides the summed gradients by the number of microbatches, so they
    are the gradient of the batch mean."""
    one_stage = SCHEDULES[cfg.schedule]["stages_per_rank"] == 1  # takes a stage, not a list
    return schedule_class(cfg.schedule)(stages[0] if one_stage else stages,
                                        n_microbatches=cfg.microbatches, loss_fn=loss)


def validate_microbatches(cfg, spec, pp_size):
    """Refuse the microbatch counts that the schedule class would refuse (after the batch
    defaults: each dp replica's batch splits into --microbatches equal pieces)."""
    m, num_stages = cfg.microbatches, pp_size * cfg.stages_per_rank
    rounds, rule = max(1, m // pp_size), spec["microbatches"]
    where = f"{cfg.schedule} with {num_stages} stages on {pp_size} ranks"
    if cfg.batch_size % (cfg.dp * m):
        fail_config("--microbatches", f"--batch-size {cfg.batch_size} must split into --dp x "
                    f"--microbatches = {cfg.dp} x {m} equal microbatches")
    if rule == "per_stage" and m < num_stages:
        fail_config("--microbatches", f"{where} needs >= {num_stages} (one per stage), got {m}")
    if rule == "rounds" and m % rounds:
        fail_config("--microbatches", f"{where} runs in max(1, m // pp) = {rounds} rounds, "
                    f"and {m} does not divide by {rounds}")


# --- building a stage -----------------------------------------------------------------------
def cut_stage(module, stage_id, num_stages):
    """Keep stage stage_id's blocks of a whole model (on the meta device), the embedding only
    on the first stage, norm and output only on the last. Blocks live in a dict keyed by
    index, so names stay the whole model's (layers.5.attention.wq.weight): the weights equal
    the single-process reference's, and checkpoint keys do not depend on the cut."""
    per_stage = len(module.layers) // num_stages
    keep = range(stage_id * per_stage, (stage_id + 1) * per_stage)
    for name in list(module.layers):
        if int(name) not in keep:
            del module.layers[name]
    if stage_id != 0:
        module.tok_embeddings = None  # TinyLlama.forward then takes hidden states as input
    if stage_id != num_stages - 1:
        module.norm, module.output = None, None
    return module


def apply_fsdp_to_stage(module, dp_mesh, low_dtype):
    """Shard one stage over "dp", one unit per block and the stage's root: all-gather before
    compute, reduce-scatter of the gradients once per step (the schedule holds the sync back
    until the last microbatch)."""
    # reshard_after_forward=False (torchtitan's default under PP): with True, each of the m
    # microbatch forwards would all-gather the stage's parameters again.
    # Low precision (bf16 on CUDA by default): gathered and used in it, reduced in fp32.
    mp_policy = (MixedPrecisionPolicy(param_dtype=low_dtype, reduce_dtype=torch.float32)
                 if low_dtype is not None else MixedPrecisionPolicy())
    for part in [*module.layers.values(), module]:
        fully_shard(part, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)
    return module


# --- precision across stages ----------------------------------------------------------------
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


def pipeline_grad_scaler(dtype, device):
    """make_grad_scaler for a pipeline: each rank holds different parameters, so one stage's
    overflow must make every stage skip the step. ShardedGradScaler (public, in
    torch.distributed.fsdp) all-reduces the inf check over the group, here the whole world;
    torch.amp.GradScaler would check this rank's stages only."""
    return ShardedGradScaler(device.type, enabled=dtype == torch.float16,
                             process_group=dist.group.WORLD)


# --- the step -------------------------------------------------------------------------------
def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def clip_grad_norm(modules, max_norm, device, counted=None):
    """clip_grad_norm_ over the whole model: each rank's local gradients are a disjoint piece
    (its stages over pp, its shard over dp, its slice over tp), so the squared norms add up
    with one all-reduce. counted(param): False for a gradient another rank holds an identical
    copy of (lab05: the norms, whole on every tp rank), so it is counted once."""
    params = [p for m in modules for p in m.parameters() if p.grad is not None]
    norms = [torch.linalg.vector_norm(local(p.grad)) for p in params
             if counted is None or counted(p)] or [torch.zeros((), device=device)]
    total_sq = torch.linalg.vector_norm(torch.stack(norms)).pow(2).reshape(1)
    dist.all_reduce(total_sq)
    total_norm = total_sq.sqrt()
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # as clip_grad_norm_ does
    for p in params:
        local(p.grad).mul_(coef)
    return total_norm


def train_step(cfg, schedule, stages, optimizers, scaler, batch, device, reports_loss=True,
               counted=None):
    """One optimizer step: the schedule runs forward and backward of every microbatch; inputs
    go to the first stage, targets to the last, which records each microbatch's loss.
    Returns the step's loss on the device where this rank holds the last stage and
    reports_loss (lab05: tp rank 0 only, so the log's sum over ranks / dp is the batch mean),
    else 0. counted: see clip_grad_norm()."""
    inputs, targets = (t.to(device, non_blocking=True) for t in batch)
    holds_first = any(s.is_first for s in stages)
    holds_last = any(s.is_last for s in stages)
    losses = []  # filled with one loss per microbatch on the rank holding the last stage
    args = (inputs,) if holds_first else ()
    kwargs = {"target": targets, "losses": losses} if holds_last else {}
    schedule.step(*args, **kwargs)
    if not holds_last:
        scaler.scale(torch.zeros((), device=device))  # scale() creates the scale on first use
    for optimizer in optimizers:
        scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
    if cfg.clip:
        clip_grad_norm([s.submod for s in stages], cfg.clip, device, counted)
    # The recorded losses are scaled (fp16); get_scale() is 1.0 when the scaler is disabled.
    loss = (torch.stack(losses).mean() / scaler.get_scale() if holds_last and reports_loss
            else torch.zeros((), device=device))
    for optimizer in optimizers:
        scaler.step(optimizer)  # skipped on every rank if any stage's fp16 grads overflowed
        optimizer.zero_grad(set_to_none=True)
    scaler.update()
    return loss.detach().reshape(1)


# --- checkpoints ----------------------------------------------------------------------------
# One DCP checkpoint for the whole pipeline. Every rank writes its own stages' tensors (and
# with FSDP or TP its shards) under the whole model's names, so the files depend on neither
# the layout nor the schedule.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # keys per parameter


def pipeline_state(modules, optimizers):
    """Per stage module: its model and optimizer state dicts, plus all of them merged."""
    parts = [(get_model_state_dict(m), get_optimizer_state_dict(m, o, options=OPTIM_OPTIONS))
             for m, o in zip(modules, optimizers)]
    merged = {"model": {k: v for part, _ in parts for k, v in part.items()},
              "optim": {k: v for _, part in parts for k, v in part.items()}}
    return parts, merged


def save_stages(cfg, modules, optimizers, step, rank):
    save_dcp_atomically(cfg, pipeline_state(modules, optimizers)[1], step, rank)


def load_stages(cfg, modules, optimizers, rank):
    """Resume this rank's stages from the newest complete checkpoint, saved on any layout.
    Returns its step (0: none)."""
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


# --- the layout check -----------------------------------------------------------------------
def check_stage_layout(stage_modules, stage_ids, num_stages, cfg, device, counted=None):
    """Every rank holds only its stages' layers, the embedding only on stage 0, norm + output
    only on the last stage, and all ranks together exactly the whole model (one all-reduce
    over every rank: a collective). counted: as in clip_grad_norm(), for copies held twice."""
    per_stage = cfg.num_layers // num_stages
    for module, stage_id in zip(stage_modules, stage_ids):
        expected = [str(i) for i in range(stage_id * per_stage, (stage_id + 1) * per_stage)]
        assert list(module.layers) == expected, (stage_id, list(module.layers))
        assert (module.tok_embeddings is not None) == (stage_id == 0)
        assert (module.output is not None) == (stage_id == num_stages - 1)
    held = sum(local(p).numel() for m in stage_modules for p in m.parameters()
               if counted is None or counted(p))
    total = torch.tensor([held], device=device)
    dist.all_reduce(total)  # every parameter element counted exactly once
    with torch.device("meta"):
        whole = sum(p.numel() for p in build_model(cfg).parameters())
    assert total.item() == whole, f"stages hold {total.item()} parameters, model has {whole}"
