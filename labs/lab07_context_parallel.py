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

Copy it: this file and the folder labkit/ beside it (torch and the standard library only).
This file is context parallelism, in the order it happens: the sequence split, ring attention
by hand (forward, backward, the log-sum-exp merge), the attention swap, the two meshes, FSDP
over all ranks, and the batches cut to each rank's tokens. labkit/ holds the rest once (flags,
model, data, the loop, metrics, DCP checkpoints, --plan, the parity reference). FSDP's own
knobs (CPU offload, reshard-after-forward, the mixed-precision choice) are lab02's subject:
here the parameters are gathered in the compute dtype and reduced in fp32, as in labs 03-05.

Use it in your project:
  - Replace: `build_model()` (run on the meta device by `build_fsdp_model()`); the attention
    class `apply_context_parallel()` swaps in (yours needs the same global RoPE positions and
    the ring in place of SDPA); `SyntheticSequences`; `loss_fn()`.
  - Keep: `shard_sequence()` on inputs and targets with the same layout the attention uses;
    the ring's `rotate()` (both directions posted together, peers as global ranks);
    `build_mesh()`'s two meshes (cp groups for the ring, all ranks for fully_shard); DCP
    checkpoints (labkit/checkpoint.py: tmp dir, then rename; any world size).
  - Pitfalls: RoPE must use each token's global position (`sequence_positions()`), not its
    local index. Every rank of a cp group must run every step of `rotate()`, even one with
    no visible block, or its neighbour waits until --timeout-s
    (runbooks/collective-timeout.md). With causal attention the contiguous split leaves the
    last rank the most work (--layout contiguous shows it). Out of memory at long sequences:
    a larger --cp, then --activation-checkpointing (runbooks/oom-mitigations.md).
"""

import contextlib
import datetime
import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from labkit.checkpoint import full_state_once, load_sharded, save_sharded
from labkit.data import micro_batches
from labkit.errors import fail_config
from labkit.flags import make_parser, planned_world_size, validate_common
from labkit.loop import announce, train_loop, train_step
from labkit.metrics import finish_run
from labkit.model import (MODEL_PRESETS, Attention, apply_block_options, apply_rope,
                          build_model, init_sharded_weights, rope_tables)
from labkit.plan import plan_or_refuse
from labkit.probes import FirstStepBytes, layout_report
from labkit.runtime import compute_dtype, init_mesh, launch, make_grad_scaler, precision_name

LAB_NAME = "lab07_context_parallel"


def parse_config(argv=None):
    parser = make_parser(LAB_NAME, __doc__, block_options=True)
    arg = parser.add_argument
    arg("--cp", type=int, default=0,
        help="context-parallel degree: ranks that split each sequence (0: all ranks); the "
             "rest of the world is data parallel")
    arg("--layout", choices=["zigzag", "contiguous"], default="zigzag",
        help="how a sequence is cut over the cp ranks: zigzag (head-tail, chunks r and "
             "2cp-1-r of 2cp: even causal work) or contiguous (chunk r of cp)")
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


def apply_fsdp(model, mesh, cfg, device):
    # One FSDP unit per block, then the root (embeddings, final norm, output), over every rank:
    # each gradient is averaged over every token of the global batch. Gathered in the compute
    # dtype (bf16 on CUDA by default), reduced in fp32.
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype(cfg, device.type),
                                  reduce_dtype=torch.float32)
    for module in [*model.layers.values(), model]:
        fully_shard(module, mesh=mesh, mp_policy=policy)


def build_fsdp_model(cfg, layout_mesh, mesh, device):
    with torch.device("meta"):  # shapes only: no rank allocates the full model
        model = build_model(cfg)
    apply_context_parallel(model, layout_mesh["cp"], cfg)
    apply_block_options(model, cfg)  # labkit: --activation-checkpointing, --compile
    apply_fsdp(model, mesh, cfg, device)
    model.to_empty(device=device)  # only the local shards, then fill them
    init_sharded_weights(model, cfg.seed)
    return model


@contextlib.contextmanager
def gradient_sync(model, enabled):
    """Accumulation micro-steps skip the reduce-scatter (FSDP keeps unsharded gradients until
    the last micro-step)."""
    model.set_requires_gradient_sync(enabled)
    yield


def train(cfg, rank, world_size, device):
    torch.manual_seed(cfg.seed)
    layout_mesh, mesh = build_mesh(cfg, device, world_size)
    model = build_fsdp_model(cfg, layout_mesh, mesh, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # after sharding
    start_step = load_sharded(cfg, model, optimizer, rank)  # labkit/checkpoint.py: DCP
    probe = FirstStepBytes(model, optimizer)  # labkit/probes.py: bytes held, from hooks
    amp_dtype = compute_dtype(cfg, device.type)
    scaler = make_grad_scaler(amp_dtype, device)
    # Each data-parallel rank reads its own sequences; the ranks of a cp group read the same
    # ones and keep their own chunks of them.
    dp_rank, dp_size = layout_mesh.get_local_rank("dp"), layout_mesh.size(0)
    batches = shard_batches(micro_batches(cfg, dp_rank, dp_size, start_step,
                                          pin_memory=device.type == "cuda"),
                            layout_mesh["cp"], cfg.layout)
    announce(cfg, rank, world_size, device, start_step,
             f"mesh {dict(zip(layout_mesh.mesh_dim_names, layout_mesh.shape))}, "
             f"{cfg.layout} split", f"compute {precision_name(amp_dtype)}",
             f"{sum(p.numel() for p in model.parameters()):,} params")
    # Every rank's loss is the mean over its own tokens, the same count on every rank.
    log = train_loop(
        cfg, rank, device, start_step, [optimizer],
        lambda step: train_step(model, optimizer, scaler, batches, cfg, device, amp_dtype,
                                gradient_sync),
        lambda step: save_sharded(cfg, model, optimizer, step, rank), loss_divisor=world_size)
    return model, layout_mesh, log, probe


def run(cfg, rank, world_size, device, wall_start):
    """Train, export, report (and check parity). Every model lives and dies in here."""
    model, layout_mesh, log, probe = train(cfg, rank, world_size, device)
    # labkit/checkpoint.py: every parameter in full on rank 0 (a collective), gathered at most
    # once, for --export now and --check-parity later
    full_state = full_state_once(cfg, model, rank)
    extra = {"cp": cfg.cp, "cp_layout": cfg.layout,
             "precision": precision_name(compute_dtype(cfg, device.type)),
             "num_params": sum(p.numel() for p in model.parameters()),
             "mesh": dict(zip(layout_mesh.mesh_dim_names, layout_mesh.shape)),
             "param_shapes": {n: list(p.shape) for n, p in model.named_parameters()},
             "layout": layout_report(model), **probe.report(world_size)}  # collectives
    # The reference trains plain attention over whole sequences, one stream per dp rank.
    finish_run(cfg, rank, world_size, device, log, compute_dtype(cfg, device.type), wall_start,
               full_state=full_state, dp_size=world_size // cfg.cp, extra=extra)


def main(argv=None):
    launch(parse_config(argv), run)  # labkit/runtime.py: init, run, and teardown in finally


if __name__ == "__main__":
    main()
