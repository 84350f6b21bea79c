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
compares every parameter (fp32 on CPU: max |diff| must be <= 1e-5) and each step's gradient
norm (relative 1e-4).

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
    done | lab08_expert_parallel | gloo x2 | 40 steps | loss 0.35... | parity 3.6e-07 | ...
Measured on torch 2.13, 2 CPU cores: the default run at 2 ranks trains in 5-8 s (12-21 s
with torchrun's start-up); the gradient norms match the reference's to ~1e-6 (relative).
The experts run one matmul per local expert; on GPUs torchtitan runs them as one grouped GEMM
(torch._grouped_mm). The loss is cross-entropy + --aux-weight x the load-balancing loss.
--plan counts every expert, as the lab shards them (not the dense model's one MLP per block).
Lesson: lessons/08_expert_parallel.py. Runbooks: runbooks/ (hangs, OOM).

Copy it: this file and the folder labkit/ beside it (torch and the standard library only).
This file is expert parallelism, in the order it happens: the experts, routing and its cap,
the balancing loss, dispatch and combine, the swap into the model, the experts sharded on
"ep", the two meshes, FSDP with the experts' divide factor, and the loss with its routing
counts. labkit/ holds the rest once (flags, model, data, the loop, metrics, DCP checkpoints,
--plan, the parity reference). FSDP's own knobs (CPU offload, reshard-after-forward, the
mixed-precision choice) are lab02's subject: here the parameters are gathered in the compute
dtype and reduced in fp32, as in labs 03-05 and 07.

Use it in your project:
  - Replace: `build_model()` (run on the meta device by `build_fsdp_model()`); the MLP that
    `build_moe_model()` swaps for `MoEFeedForward`; `SyntheticSequences`; `loss_fn()`.
  - Keep: `dispatch_and_combine()` (counts first, then two uneven all-to-alls, both
    differentiable); `apply_expert_parallel()` (experts as Shard(0) DTensors on "ep": whole-
    model names in checkpoints); `clip_grad_norm_()` (one norm over several meshes); DCP
    `save_sharded()` / `load_sharded()` (labkit: tmp dir, then rename; any world size or --ep).
  - Pitfalls: every rank of an ep group must run every all-to-all of every block
    (`dispatch_and_combine()`), even with no token for anyone, or its peers wait until
    --timeout-s (runbooks/collective-timeout.md). Expert gradients reach an ep rank from its
    whole group: at FSDP's default divide factor (dp) they are ep times too large
    (`apply_fsdp()` sets dp x ep; the parity check's gradient norms see it). A router that
    favours one expert makes its rank the straggler and the memory peak: watch "expert_load",
    raise --aux-weight or set --capacity-factor (runbooks/oom-mitigations.md).
"""

import contextlib
import datetime
import math

import torch
import torch.distributed as dist
# The differentiable all-to-all (torch.distributed.nn.functional's is deprecated in torch 2.13
# and points here). The module name has an underscore, but it is what torch's own DTensor and
# torchtitan's expert-parallel code call; lessons/moe_workers.py uses the same.
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from labkit.checkpoint import full_state_once, load_sharded, save_sharded
from labkit.data import micro_batches
from labkit.errors import fail_config, refuse_negative
from labkit.flags import make_parser, planned_world_size, validate_common
from labkit.loop import announce, train_loop, train_step
from labkit.metrics import finish_run
from labkit.model import apply_block_options, build_model, init_sharded_weights, loss_fn
from labkit.parity import Reference
from labkit.plan import plan_or_refuse
from labkit.probes import layout_report
from labkit.runtime import compute_dtype, init_mesh, launch, make_grad_scaler, precision_name

LAB_NAME = "lab08_expert_parallel"


def parse_config(argv=None):
    parser = make_parser(LAB_NAME, __doc__, block_options=True)
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
    """What each rank holds, for estimate_memory() and --plan: every expert counts in a block's
    state (sharded over ep x dp, the world), a rank gathers its ep group's experts, and each
    token's activations hold top-k experts' hidden tensors."""
    return {"mesh": f"dp={world_size // cfg.ep}, ep={cfg.ep}; dense params fully_shard over all "
                    f"{world_size} ranks, experts over dp",
            "what": f"{cfg.num_experts} experts, top-{cfg.top_k}, all-to-all over ep; "
                    "fully_shard, one unit per block",
            "precision": "MixedPrecisionPolicy: params gathered in the compute dtype, grads "
                         "reduced in fp32, fp32 master shards",
            "state_shards": world_size, "optimizer_shards": world_size,
            "tp": 1, "layers": cfg.num_layers, "in_flight": 1,
            "micro_batch": cfg.batch_size // (world_size * cfg.grad_accum),
            "fsdp": True, "ddp_buckets": False,
            "experts": (cfg.num_experts, cfg.top_k, cfg.ep)}


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
    refuse_negative(cfg, ["capacity_factor", "aux_weight"])


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
    `routed` its counts per expert (before the cap, and kept), for RoutedLoss to read."""

    def __init__(self, cfg):
        super().__init__()
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.ffn_dim)
        self.top_k, self.capacity_factor = cfg.top_k, cfg.capacity_factor
        # Set by apply_expert_parallel (groups) and build_moe_model (num_groups).
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


def build_moe_model(cfg, num_groups=1):
    """The lab's model: the kit's TinyLlama with each block's MLP a mixture of experts.
    num_groups: ranks whose micro-batches one forward routes at once (the one-process
    reference routes every rank's, each under its own cap)."""
    model = build_model(cfg)
    dtype = model.output.weight.dtype  # float64 under --parity-dtype float64
    for block in model.layers.values():
        block.feed_forward = MoEFeedForward(cfg)
        block.feed_forward.num_groups = num_groups
    return model.to(dtype)


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


# --- sharding: the experts on "ep", everything on FSDP ------------------------------------------
def build_mesh(cfg, device, world_size):
    """Three views of the same ranks. ("dp", "ep"), ep inner: an ep group is ep consecutive
    ranks (one node, on GPUs), where the all-to-alls run; "dp" shards the experts.
    ("dp_ep",): all ranks, for the dense parameters' fully_shard, which then averages each
    gradient over every token of the global batch."""
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    layout_mesh = init_mesh(device.type, (world_size // cfg.ep, cfg.ep), ("dp", "ep"), timeout)
    fsdp_mesh = init_mesh(device.type, (world_size,), ("dp_ep",), timeout)
    return layout_mesh, fsdp_mesh


def apply_fsdp(model, layout_mesh, mesh, cfg, device):
    """fully_shard bottom-up. The experts first, over "dp" only (ep already splits them):
    their gradient on an ep rank is the sum over every rank of its ep group (the all-to-all's
    backward brings it), so the reduce-scatter over dp must divide by dp x ep = world size,
    not by dp, for the mean over the global batch. Then each block over all ranks (one
    all-gather in forward, one all-gather + one reduce-scatter in backward), and the root.
    Gathered in the compute dtype (bf16 on CUDA by default), reduced in fp32."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype(cfg, device.type),
                                  reduce_dtype=torch.float32)
    world_size, dp_size = mesh.size(), layout_mesh["dp"].size()
    for moe in moe_layers(model):
        # Shard(1), not dim 0: dim 0 is ep's, and num_experts/ep rows would rarely split
        # evenly over dp. Dim 1 (hidden, or dim for w2) does.
        fully_shard(moe.experts, mesh=layout_mesh["dp"], mp_policy=policy,
                    shard_placement_fn=lambda param: Shard(1))
        moe.experts.set_gradient_divide_factor(world_size)
        # A factor other than dp makes FSDP reduce with NCCL's PREMUL_SUM (scale, then sum, in
        # one kernel), which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): there,
        # a plain SUM, then the division. Not at dp 1, where nothing is reduced: torch 2.13
        # then divides by the factor twice (once in the copy, once after); parity shows it.
        moe.experts.set_force_sum_reduction_for_comms(device.type != "cuda" and dp_size > 1)
    for module in [*model.layers.values(), model]:
        fully_shard(module, mesh=mesh, mp_policy=policy)


def build_fsdp_model(cfg, layout_mesh, mesh, device):
    with torch.device("meta"):  # shapes only: no rank allocates the full model
        model = build_moe_model(cfg)
        apply_expert_parallel(model, layout_mesh["ep"], mesh)
    apply_block_options(model, cfg)  # labkit: --activation-checkpointing, --compile
    apply_fsdp(model, layout_mesh, mesh, cfg, device)
    model.to_empty(device=device)  # only the local shards, then fill them
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


@contextlib.contextmanager
def gradient_sync(model, enabled):
    """Accumulation micro-steps skip the reduce-scatter (FSDP keeps unsharded gradients until
    the last micro-step). The all-to-alls still run."""
    model.set_requires_gradient_sync(enabled)
    yield


# --- the loss, and what routing did ---------------------------------------------------------
class RoutedLoss:
    """The lab's loss, for the kit's train_step: cross-entropy + --aux-weight x the blocks'
    mean balancing loss. It also sums each block's routing choices per expert (before the
    cap, and kept) over the steps, on the device: "expert_load" and "tokens_dropped"."""

    def __init__(self, cfg, device):
        self.aux_weight = cfg.aux_weight
        self.routed = torch.zeros(cfg.num_layers, 2, cfg.num_experts, dtype=torch.long,
                                  device=device)

    def __call__(self, model, logits, targets):
        layers = moe_layers(model)
        self.routed += torch.stack([moe.routed for moe in layers])
        aux = torch.stack([moe.aux_loss for moe in layers]).mean()
        return loss_fn(logits, targets) + self.aux_weight * aux


class MoEReference(Reference):
    """--check-parity's one-process run (labkit/parity.py), every expert local: each
    micro-step is every rank's micro-batch at once (the balancing loss is over exactly those
    tokens), routed with the cap applied to each rank's slice, as the ranks apply it."""

    joint_micro_steps = True

    def __init__(self, cfg, world_size, device):
        self.num_groups, self.routed_loss = world_size, RoutedLoss(cfg, device)

    def build(self, cfg):
        return build_moe_model(cfg, num_groups=self.num_groups)

    def loss(self, model, logits, targets):
        return self.routed_loss(model, logits, targets)

    def report(self):
        return {"reference_expert_load": self.routed_loss.routed[:, 0].tolist()}


def train(cfg, rank, world_size, device):
    torch.manual_seed(cfg.seed)
    layout_mesh, mesh = build_mesh(cfg, device, world_size)
    model = build_fsdp_model(cfg, layout_mesh, mesh, device)
    optimizer = build_optimizer(cfg, model)  # after sharding
    start_step = load_sharded(cfg, model, optimizer, rank)  # labkit/checkpoint.py: DCP
    amp_dtype = compute_dtype(cfg, device.type)
    scaler = make_grad_scaler(amp_dtype, device)
    # Every rank reads its own sequences (the ranks of an ep group too: they share experts,
    # not data).
    batches = micro_batches(cfg, rank, world_size, start_step, pin_memory=device.type == "cuda")
    routed_loss, grad_norms = RoutedLoss(cfg, device), []
    announce(cfg, rank, world_size, device, start_step,
             f"mesh {dict(zip(layout_mesh.mesh_dim_names, layout_mesh.shape))}, "
             f"{cfg.num_experts} experts top-{cfg.top_k}", f"compute {precision_name(amp_dtype)}",
             f"{sum(p.numel() for p in model.parameters()):,} params")
    log = train_loop(
        cfg, rank, device, start_step, [optimizer],
        lambda step: train_step(model, optimizer, scaler, batches, cfg, device, amp_dtype,
                                gradient_sync, routed_loss, grad_norms),
        lambda step: save_sharded(cfg, model, optimizer, step, rank), loss_divisor=world_size)
    return model, layout_mesh, log, routed_loss, grad_norms


def run(cfg, rank, world_size, device, wall_start):
    """Train, export, report (and check parity). Every model lives and dies in here."""
    model, layout_mesh, log, routed_loss, grad_norms = train(cfg, rank, world_size, device)
    # labkit/checkpoint.py: every parameter in full on rank 0 (a collective), gathered at most
    # once, for --export now and --check-parity later
    full_state = full_state_once(cfg, model, rank)
    routed = routed_loss.routed.clone()
    dist.all_reduce(routed)  # every rank's routing choices, this run's steps
    extra = {"ep": cfg.ep, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
             "precision": precision_name(compute_dtype(cfg, device.type)),
             "num_params": sum(p.numel() for p in model.parameters()),
             "mesh": dict(zip(layout_mesh.mesh_dim_names, layout_mesh.shape)),
             "parameter_shapes": {n: list(p.shape) for n, p in model.named_parameters()},
             "layout": layout_report(model),  # a collective
             # Per block, per expert: routing choices over all ranks and steps, before the cap.
             "expert_load": routed[:, 0].tolist(),
             "tokens_dropped": int((routed[:, 0] - routed[:, 1]).sum())}
    finish_run(cfg, rank, world_size, device, log, compute_dtype(cfg, device.type), wall_start,
               full_state=full_state, extra=extra, grad_norms=grad_norms,
               reference=MoEReference(cfg, world_size, device))


def main(argv=None):
    launch(parse_config(argv), run)  # labkit/runtime.py: init, run, and teardown in finally


if __name__ == "__main__":
    main()
