"""Lab 03: 2D parallelism, tensor parallel (TP) inside a node and FSDP across nodes.

What it teaches: a 2D DeviceMesh ("dp", "tp"). Inside each transformer block the Megatron-LM
plan splits attention by heads and the MLP by its hidden width (column-parallel, then
row-parallel), so the ranks of one "tp" group share every matmul and exchange activations
several times per block: fast links only. Then fully_shard shards the TP-sharded weights again
over "dp", whose ranks exchange only FSDP's all-gathers and reduce-scatters: that traffic can
cross nodes. --sequence-parallel also shards the norms and residual stream on the sequence dim;
--loss-parallel computes the loss on vocab-sharded logits. `--check-parity` retrains the same
global batches in one process and compares every parameter in fp32 (max |diff| <= 1e-5; about
3e-7 here). That needs the learning-rate warmup: TP reorders floating-point sums, and AdamW's
first step turns that rounding into a full step (the kit's `learning_rate()` says why; lesson
03 measures it). `--count-comms` counts one step's collectives by type with
CommDebugMode, and the activation bytes saved for backward (labkit/probes.py).

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

Copy it: this file and the folder labkit/ beside it (torch and the standard library only).
This file is 2D parallelism, in the order it happens: the (dp, tp) mesh, the TP plan per block
and for the root, parallelize_module, fully_shard over "dp", the weights filled shard by
shard, and the loss-parallel step. labkit/ holds the rest once (flags, model, data, the loop,
metrics, DCP checkpoints that load into another mesh shape, --plan, the probes).

Use it in your project:
  - Replace: the keys of `block_plan()` and `root_plan()` with your module names
    (`check_plan_keys()` makes a key that matches nothing an error; parallelize_module only
    warns); `build_model()`; `init_sharded_weights()`; `SyntheticSequences`; `loss_fn()`.
  - Keep: `apply_tp()` before `apply_fsdp()` (FSDP shards the TP shards again, over "dp");
    "tp" as the last axis in `build_mesh()`, so a TP group is consecutive ranks of one node:
    `--tp` at most the GPUs per node; data split over "dp" only (TP ranks need the same
    batch); from labkit: the per-mesh `clip_grad_norm_()`, DCP checkpoints that load into
    another mesh shape, the warmup in `learning_rate()` (without it, parity fails by ~1e-4).
  - Pitfalls: `--tp` must divide the heads, `--dim`, the MLP width, `--vocab-size` (and
    `--seq-len` with SP), see `validate_tp()`. Attention must take its head count from the
    local width, as `Attention` does. With SP, a norm left out of the plan trains, wrongly
    (`--check-parity` after 10 steps: 2.6e-2, not 1.2e-7). full_tensor and unshard are
    collectives: on every rank, as in `full_parameters()` (runbooks/collective-timeout.md).
"""

import contextlib
import datetime
import functools

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)

from labkit.checkpoint import load_sharded, save_sharded
from labkit.data import micro_batches
from labkit.errors import fail_config
from labkit.flags import apply_model_preset, make_parser, planned_world_size, validate_common
from labkit.loop import announce, train_loop, train_step
from labkit.metrics import finish_run
from labkit.model import build_model, check_plan_keys, init_sharded_weights
from labkit.plan import plan_or_refuse
from labkit.probes import FirstStepBytes, StepCosts
from labkit.runtime import compute_dtype, init_mesh, launch, make_grad_scaler, precision_name

LAB_NAME = "lab03_tp_fsdp"


def parse_config(argv=None):
    parser = make_parser(LAB_NAME, __doc__, count_comms=True)
    arg = parser.add_argument
    arg("--tp", type=int, default=0,
        help="tensor-parallel degree: ranks per TP group (keep it inside a node); dp = world / "
             "tp (0: 2 when the world size is even, else 1)")
    arg("--sequence-parallel", action="store_true",
        help="shard norms and the residual stream on the sequence dim (TP all-reduces become "
             "all-gather + reduce-scatter pairs)")
    arg("--loss-parallel", action="store_true",
        help="cross-entropy on vocab-sharded logits instead of all-gathering the logits")
    cfg = parser.parse_args(argv)
    if cfg.model == "debug":  # per TP group: the 2 ranks of a tp=2 group share it
        cfg.micro_batch_size = cfg.micro_batch_size or 16
    world_size = planned_world_size(cfg)
    cfg.tp = cfg.tp or (2 if world_size % 2 == 0 else 1)
    apply_model_preset(cfg)  # validate_tp checks the model's widths
    validate_tp(cfg, world_size)
    validate_common(cfg, world_size, dp_size=world_size // cfg.tp)
    plan_or_refuse(cfg, plan_layout(cfg, world_size), world_size)
    return cfg


def plan_layout(cfg, world_size):
    """What each rank holds on the (dp, tp) mesh, for estimate_memory() and --plan."""
    dp_size = world_size // cfg.tp
    return {"mesh": f"dp={dp_size}, tp={cfg.tp}",
            "what": "TP inside each block (heads, MLP width, vocab), fully_shard over dp",
            "precision": "MixedPrecisionPolicy: params gathered in the compute dtype, grads "
                         "reduced in fp32, fp32 master shards",
            "state_shards": world_size, "optimizer_shards": world_size, "tp": cfg.tp,
            "layers": cfg.num_layers, "in_flight": 1,
            "micro_batch": cfg.batch_size // (dp_size * cfg.grad_accum),
            "fsdp": True, "sequence_parallel": cfg.sequence_parallel, "ddp_buckets": False}


def validate_tp(cfg, world_size):
    """TP splits heads, the model and MLP widths, the vocabulary and (with SP) the sequence
    into tp equal slices; each must divide evenly, and tp must divide the world."""
    if cfg.tp < 0:
        fail_config("--tp", f"must be >= 0, got {cfg.tp}")
    if world_size % cfg.tp:
        divisors = [t for t in range(1, world_size + 1) if world_size % t == 0]
        fail_config("--tp", f"{cfg.tp} does not divide the world size {world_size} (the mesh is "
                    f"(dp, tp) = (world / tp, tp)); allowed: {', '.join(map(str, divisors))}")
    sizes = {"--num-heads": cfg.num_heads, "--num-kv-heads": cfg.num_kv_heads, "--dim": cfg.dim,
             "--ffn-dim (MLP width)": cfg.ffn_dim, "--vocab-size": cfg.vocab_size}
    if cfg.sequence_parallel:
        sizes["--seq-len (with --sequence-parallel)"] = cfg.seq_len
    for flag, size in sizes.items():
        if size % cfg.tp:
            allowed = [t for t in range(1, world_size + 1)
                       if world_size % t == 0 and all(s % t == 0 for s in sizes.values())]
            fail_config("--tp", f"{cfg.tp} does not divide {flag} = {size}: each TP rank needs "
                        f"an equal slice; allowed: {', '.join(map(str, allowed))}")


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
    # Low precision (bf16 on CUDA by default): gathered and used in it, reduced in fp32.
    low = compute_dtype(cfg, device.type)
    mp_policy = (MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
                 if low is not None else MixedPrecisionPolicy())
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)  # root: embeddings, norm, output


def build_parallel_model(cfg, mesh, device):
    with torch.device("meta"):  # no full copy of the model on any rank
        model = build_model(cfg)
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


def full_parameters(model):
    """{name: full tensor} of every parameter, for --check-parity. Collectives, so every rank
    takes part: FSDP's all-gather over "dp" gives the tp-local weights, then full_tensor()
    all-gathers those over "tp" (one collective per axis, in that order)."""
    for module in [*model.layers.values(), model]:
        module.unshard()
    return {name: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for name, p in model.named_parameters()}


@contextlib.contextmanager
def micro_step(parallel_loss, model, enabled):
    """The context of one micro-step's forward, loss and backward (labkit's train_step). FSDP
    reduce-scatters the gradients on the last micro-step only. loss_parallel must cover the
    backward too: it swaps in the gradient of the loss on vocab-sharded logits."""
    model.set_requires_gradient_sync(enabled)
    with loss_parallel() if parallel_loss else contextlib.nullcontext():
        yield


def train(cfg, rank, world_size, device):
    mesh = build_mesh(cfg, world_size, device)
    dp_size, tp_size = mesh["dp"].size(), mesh["tp"].size()
    model = build_parallel_model(cfg, mesh, device)
    extra = {"mesh": [dp_size, tp_size], **inspect_tp_fsdp(model, cfg, tp_size)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    start_step = load_sharded(cfg, model, optimizer, rank)  # labkit/checkpoint.py: DCP
    probes = FirstStepBytes(model, optimizer), StepCosts(cfg, model, mesh)  # labkit/probes.py
    # Low precision: FSDP already gathers bf16 weights. Autocast is kept as in lab01 (--amp).
    low = compute_dtype(cfg, device.type)
    scaler = make_grad_scaler(low, device)
    # TP ranks must see the same batch: data is split over "dp" only.
    batches = micro_batches(cfg, mesh["dp"].get_local_rank(), dp_size, start_step,
                            pin_memory=device.type == "cuda")
    announce(cfg, rank, world_size, device, start_step, f"mesh (dp, tp) = ({dp_size}, {tp_size})",
             f"sp {cfg.sequence_parallel} | loss parallel {cfg.loss_parallel}",
             f"params {str(next(model.parameters()).dtype)[6:]}, compute {precision_name(low)}")
    sync = functools.partial(micro_step, cfg.loss_parallel)
    # Summed over every rank: tp ranks hold the same loss, so divide by the world.
    log = train_loop(
        cfg, rank, device, start_step, [optimizer],
        lambda step: train_step(model, optimizer, scaler, batches, cfg, device, low, sync),
        lambda step: save_sharded(cfg, model, optimizer, step, rank),
        loss_divisor=world_size, first_step_probe=probes[1])
    for probe in probes:
        extra.update(probe.report(world_size))
    return model, log, dp_size, extra


def run(cfg, rank, world_size, device, wall_start):
    """Train, check parity, report. Every model lives and dies in here."""
    model, log, dp_size, extra = train(cfg, rank, world_size, device)
    # The reference splits the batch over dp only, as this run does (TP ranks share a batch).
    low = compute_dtype(cfg, device.type)
    finish_run(cfg, rank, world_size, device, log, low, wall_start,
               full_state=lambda: full_parameters(model), dp_size=dp_size,
               extra={"precision": precision_name(low), **extra})


def main(argv=None):
    launch(parse_config(argv), run)  # labkit/runtime.py: init, run, and teardown in finally


if __name__ == "__main__":
    main()
