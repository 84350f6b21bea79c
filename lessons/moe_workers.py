"""Worker functions for lessons/08_expert_parallel.py (run with spawn.run_workers).

A small top-k mixture-of-experts layer, twice:
  * `moe_reference`: one process, every expert local, a plain loop over experts;
  * `moe_expert_parallel`: the experts spread over the ranks (rank r holds experts
    r*E/p .. (r+1)*E/p - 1), every rank routes its own tokens, and two `all_to_all_single`
    calls move them: dispatch (tokens to their experts' ranks) and combine (results back).
    The splits are uneven, so the counts are exchanged first.
Both keep the same tokens when an expert is over capacity (the earliest tokens of the global
batch), so with or without dropping they compute the same thing, up to float reassociation.
"""

import math

import torch
import torch.distributed as dist
# The differentiable collectives. torch.distributed.nn.functional's versions are deprecated in
# torch 2.13 and point here; the module name has an underscore, but it is what torch's own
# DTensor and torchtitan's expert-parallel code call.
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

DIM, HIDDEN, NUM_EXPERTS, TOP_K = 32, 64, 8, 2
AUX_WEIGHT = 0.01  # Switch Transformer's alpha


# --- the layer's parameters, the same on every rank ------------------------------------------

def make_params(seed=0, num_experts=NUM_EXPERTS, dim=DIM, hidden=HIDDEN):
    """Router [E, dim], and per expert w_in [hidden, dim], w_out [dim, hidden]."""
    generator = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(num_experts, dim, generator=generator) / math.sqrt(dim),
            "w_in": torch.randn(num_experts, hidden, dim, generator=generator) / math.sqrt(dim),
            "w_out": torch.randn(num_experts, dim, hidden, generator=generator) / math.sqrt(hidden)}


def make_tokens(num_tokens, seed=1, skew=0.0, dim=DIM):
    """Token activations, and a regression target. skew > 0 adds one shared direction to
    every token, so an untrained router sends most of them to the same few experts."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, dim, generator=generator)
    x = x + skew * torch.randn(dim, generator=generator)
    target = torch.tanh(x @ torch.randn(dim, dim, generator=generator) / math.sqrt(dim))
    return x, target


def expert_mlp(x, w_in, w_out):
    return F.gelu(x @ w_in.T) @ w_out.T


def capacity(num_tokens, capacity_factor, num_experts=NUM_EXPERTS, top_k=TOP_K):
    """Slots per expert: capacity_factor x the tokens a perfectly balanced router would send."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


# --- routing: the same code in both versions --------------------------------------------------

def route(x, router, top_k=TOP_K):
    """Each token's top-k experts and their gates (softmax over the chosen k), plus the full
    router probabilities (the balancing loss needs them)."""
    probs = torch.softmax(x @ router.T, dim=-1)
    top_probs, experts = probs.topk(top_k, dim=-1)
    gates = top_probs / top_probs.sum(-1, keepdim=True)
    return experts, gates, probs


def balancing_loss(expert_counts, prob_sums, num_tokens, top_k=TOP_K):
    """Switch Transformer's auxiliary loss, for top-k: E * sum_e f_e * P_e, with f_e the share
    of routing choices that went to expert e and P_e the mean router probability of e. It is
    1.0 for a perfectly uniform router and grows as the load concentrates; only P_e carries a
    gradient (f_e comes from a top-k, which has none)."""
    num_experts = expert_counts.numel()
    share = expert_counts.float() / (num_tokens * top_k)
    mean_prob = prob_sums / num_tokens
    return num_experts * (share * mean_prob).sum()


# --- one process ------------------------------------------------------------------------------

def moe_reference(x, params, capacity_factor, top_k=TOP_K):
    """The layer in one process: a loop over experts. Returns (out, stats)."""
    num_tokens, num_experts = x.shape[0], params["router"].shape[0]
    experts, gates, probs = route(x, params["router"], top_k)
    cap = capacity(num_tokens, capacity_factor, num_experts, top_k)
    out = torch.zeros_like(x)
    counts = torch.zeros(num_experts, dtype=torch.long)
    dropped = 0
    for e in range(num_experts):
        token_idx, slot = (experts == e).nonzero(as_tuple=True)  # in token order
        counts[e] = token_idx.numel()
        kept = token_idx[:cap], slot[:cap]  # over capacity: the latest tokens are dropped
        dropped += token_idx.numel() - kept[0].numel()
        y = expert_mlp(x[kept[0]], params["w_in"][e], params["w_out"][e])
        out = out.index_add(0, kept[0], y * gates[kept].unsqueeze(-1))
    aux = balancing_loss(counts, probs.sum(0), num_tokens, top_k)
    return out, {"counts": counts, "dropped": dropped, "aux": aux, "aux_share": aux,
                 "capacity": cap}


# --- expert parallelism by hand ---------------------------------------------------------------

def exchange_counts(send_counts, group=None):
    """send_counts[r][j]: how many tokens this rank sends to rank r's j-th local expert.
    Returns the transpose seen from the receiver: recv_counts[r][j] from rank r."""
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return recv_counts


def moe_expert_parallel(x, params, capacity_factor, top_k=TOP_K, group=None, traffic=None):
    """The layer with experts spread over the group. x: this rank's tokens (rank r holds the
    r-th block of the global batch). params["w_in"] / ["w_out"]: this rank's experts only;
    the router is replicated. Returns (out for this rank's tokens, stats)."""
    group = group or dist.group.WORLD  # funcol wants the group named
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    num_local, num_experts = params["w_in"].shape[0], params["router"].shape[0]
    num_tokens = x.shape[0]

    # 1. Route locally; sort this rank's (token, slot) choices by expert, which also groups
    #    them by destination rank (experts are laid out rank by rank).
    experts, gates, probs = route(x, params["router"], top_k)
    flat_expert = experts.flatten()
    order = torch.argsort(flat_expert, stable=True)  # stable: token order within an expert
    token_of = order // top_k
    send_counts = torch.bincount(flat_expert, minlength=num_experts).view(world_size, num_local)

    # 2. Counts first: each rank learns how many tokens it will receive, per source and expert.
    recv_counts = exchange_counts(send_counts, group)

    # 3. Dispatch: uneven all-to-all of the token activations (differentiable).
    send_split = send_counts.sum(1).tolist()
    recv_split = recv_counts.sum(1).tolist()
    received = funcol.all_to_all_single(x[token_of], recv_split, send_split, group)

    # 4. Each local expert takes its tokens in global order (source rank, then token), keeps
    #    the first `capacity` of them, and runs.
    global_tokens = num_tokens * world_size
    cap = capacity(global_tokens, capacity_factor, num_experts, top_k)
    outputs, dropped = expert_outputs(received, recv_counts, params, cap)

    # 5. Combine: the reverse all-to-all, then weight by the gates and add per token.
    returned = funcol.all_to_all_single(outputs, send_split, recv_split, group)
    out = torch.zeros_like(x).index_add(0, token_of, returned * gates.flatten()[order, None])
    if traffic is not None:
        traffic.append(bytes_sent(send_counts, rank, x))

    aux, aux_share, dropped_all = global_statistics(flat_expert, probs, dropped, global_tokens,
                                                     top_k, group)
    return out, {"counts": aux["counts"], "dropped": dropped_all, "aux": aux["value"],
                 "aux_share": aux_share, "capacity": cap}


def global_statistics(flat_expert, probs, dropped, global_tokens, top_k, group):
    """The balancing loss over the global batch, and this rank's share of it. f_e (the counts)
    has no gradient, so aux = sum over ranks of E * sum_e f_e * (this rank's prob sum_e) / N:
    each rank back-propagates its own term, and the router's gradient, summed over the ranks
    like the rest of it, is aux's. No differentiable all-reduce is needed."""
    num_experts = probs.shape[-1]
    counts = torch.bincount(flat_expert, minlength=num_experts)
    dist.all_reduce(counts, group=group)
    aux_share = balancing_loss(counts, probs.sum(0), global_tokens, top_k)
    totals = torch.stack([aux_share.detach(), torch.tensor(float(dropped))])
    dist.all_reduce(totals, group=group)
    return {"counts": counts, "value": totals[0]}, aux_share, int(totals[1])


def expert_outputs(received, recv_counts, params, cap):
    """Run each local expert on its received tokens; a token over capacity gets zeros (its
    gate then multiplies nothing, as in the reference). Rows stay in the received order."""
    world_size, num_local = recv_counts.shape
    # received is laid out [source 0: expert 0.., expert 1..; source 1: ...]; find each row's
    # expert and its rank among that expert's tokens in (source, token) order.
    expert_of = torch.arange(num_local).repeat(world_size).repeat_interleave(recv_counts.flatten())
    outputs = torch.zeros_like(received)
    dropped = 0
    for e in range(num_local):
        rows = (expert_of == e).nonzero(as_tuple=True)[0]  # source-major: global token order
        kept = rows[:cap]
        dropped += rows.numel() - kept.numel()
        y = expert_mlp(received[kept], params["w_in"][e], params["w_out"][e])
        outputs = outputs.index_copy(0, kept, y)
    return outputs, dropped


def bytes_sent(send_counts, rank, x):
    """Bytes this rank's dispatch puts on the wire (tokens for its own experts stay home);
    the combine sends the same number back."""
    leaving = send_counts.sum(1).clone()
    leaving[rank] = 0
    return int(leaving.sum()) * x.shape[1] * x.element_size()


# --- workers ----------------------------------------------------------------------------------

def local_experts(params, rank, world_size):
    per_rank = params["router"].shape[0] // world_size
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    return {"router": params["router"].clone(), "w_in": params["w_in"][sl].clone(),
            "w_out": params["w_out"][sl].clone()}


def train_steps(layer, params, x, target, num_global_tokens, steps, lr, aux_weight,
                capacity_factor, replicated_router):
    """SGD on the mean-squared error over the global batch + aux_weight x the balancing loss.
    With replicated_router, the router's gradient is summed over the ranks (each rank's loss
    covers only its own tokens). Returns each step's routing statistics."""
    for p in params.values():
        p.requires_grad_()
    history = []
    for _ in range(steps):
        out, stats = layer(x, params, capacity_factor)
        loss = ((out - target) ** 2).sum() / num_global_tokens
        (loss + aux_weight * stats["aux_share"]).backward()
        if replicated_router:
            dist.all_reduce(params["router"].grad)
        with torch.no_grad():
            for p in params.values():
                p -= lr * p.grad
                p.grad = None
        history.append({"counts": stats["counts"].tolist(), "dropped": stats["dropped"],
                        "aux": float(stats["aux"].detach())})
    return history


def train_reference(x, target, steps, lr, aux_weight, capacity_factor):
    """The same training in one process (the parity reference, and the balancing study)."""
    params = make_params()
    history = train_steps(moe_reference, params, x, target, x.shape[0], steps, lr, aux_weight,
                          capacity_factor, replicated_router=False)
    return {name: p.detach() for name, p in params.items()}, history


def ep_parity(rank, world_size, num_tokens, capacity_factors, steps, lr):
    """Per capacity factor: this rank's output and gradients after one forward/backward, then
    its parameters after `steps` SGD steps, and the bytes it sent."""
    results = {}
    x_all, target_all = make_tokens(num_tokens)
    block = num_tokens // world_size
    x = x_all[rank * block:(rank + 1) * block].clone().requires_grad_()
    target = target_all[rank * block:(rank + 1) * block]
    for cf in capacity_factors:
        params = local_experts(make_params(), rank, world_size)
        for p in params.values():
            p.requires_grad_()
        traffic = []
        out, stats = moe_expert_parallel(x, params, cf, traffic=traffic)
        out.backward(target)  # a fixed upstream gradient: d(sum(out * target))
        dist.all_reduce(params["router"].grad)
        grads = {name: p.grad.clone() for name, p in params.items()}
        x_grad = x.grad.clone()
        x.grad = None
        params = local_experts(make_params(), rank, world_size)
        history = train_steps(moe_expert_parallel, params, x.detach(), target, num_tokens,
                              steps, lr, AUX_WEIGHT, cf, replicated_router=True)
        results[cf] = {"out": out.detach(), "x_grad": x_grad, "grads": grads,
                       "dropped": stats["dropped"], "counts": stats["counts"].tolist(),
                       "params": {n: p.detach() for n, p in params.items()},
                       "bytes_sent": traffic[0], "history": history}
    return results
