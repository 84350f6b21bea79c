"""Checks for exercise zero1 (a ZeRO-1 sharded optimizer), at 2 ranks and then at 3, where
the 8 parameters do not split evenly. The contract is in exercises/zero1.py.

The grader makes the gradients itself, identical on every rank (as they are after DDP's
all-reduce), steps the learner's optimizer and a plain one over all the parameters in one
process, and compares every parameter on every rank. Which parameters each rank's inner
optimizer holds, and how many bytes of state, comes from local_optimizer(opt).
"""

import torch

from .compare import (TOL, differing, format_bytes, max_abs_diff, name_list, same,
                      state_bytes)
from .checks import Check, Exercise, failed, passed

# A small model's parameters, in the order make_zero1 gets them: the 2-D ones (weight decay)
# first, then the 1-D ones (none). 8 parameters: even at 2 ranks, uneven at 3.
SHAPES = {
    "embed.weight": (32, 16),
    "fc1.weight": (64, 16),
    "fc2.weight": (16, 64),
    "head.weight": (24, 16),
    "fc1.bias": (64,),
    "fc2.bias": (16,),
    "norm.weight": (16,),
    "norm.bias": (16,),
}
NAMES = list(SHAPES)
NO_DECAY = [name for name in NAMES if len(SHAPES[name]) == 1]
NUM_STEPS = 3
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


def build_params():
    """Fresh Parameters, the same values on every rank (no broadcast needed at the start)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(0.1 * torch.randn(shape, generator=generator))
            for shape in SHAPES.values()]


def param_groups(params, grouped):
    """grouped: two groups, weight decay off for the 1-D parameters; else a plain list."""
    if not grouped:
        return list(params)
    named = dict(zip(NAMES, params))
    return [{"params": [named[n] for n in NAMES if n not in NO_DECAY]},
            {"params": [named[n] for n in NO_DECAY], "weight_decay": 0.0}]


def set_grads(params, step):
    """The gradients of `step`: the same on every rank, as after DDP."""
    generator = torch.Generator().manual_seed(1000 + step)
    for param in params:
        param.grad = 0.1 * torch.randn(param.shape, generator=generator)


def train_reference(optimizer_spec, grouped, num_steps):
    optimizer_class, defaults = optimizer_spec
    params = build_params()
    optimizer = optimizer_class(param_groups(params, grouped), **defaults)
    for step in range(num_steps):
        set_grads(params, step)
        optimizer.step()
    return params, optimizer


def train_learner(ctx, optimizer_spec, grouped, num_steps):
    optimizer_class, defaults = optimizer_spec
    params = build_params()
    opt = ctx.entry("make_zero1")(param_groups(params, grouped), optimizer_class, **defaults)
    for step in range(num_steps):
        set_grads(params, step)
        opt.step()
    return params, opt


def owned_names(ctx, opt, params):
    """Names of the parameters in this rank's inner optimizer, or a ValueError saying why the
    grader cannot tell (the inner optimizer holds copies, not the parameters passed in)."""
    by_id = {id(p): name for name, p in zip(NAMES, params)}
    held = [p for group in ctx.entry("local_optimizer")(opt).param_groups for p in group["params"]]
    strangers = [p for p in held if id(p) not in by_id]
    if strangers:
        raise ValueError(f"local_optimizer(opt) holds {len(strangers)} tensor(s) that are not "
                         "the parameters given to make_zero1 (copies?): the contract needs "
                         "the original Parameter objects")
    return [by_id[id(p)] for p in held]


def explain_params(wrong, got, initial, owners, no_decay, world_size):
    """Why some parameters differ on this rank, in terms of the usual mistakes."""
    stale = [n for n in wrong if same(got[n], initial[n])]
    orphans = [n for n in stale if not owners[n]]
    if orphans:
        return (f"{name_list(orphans)} never updated, and no rank's optimizer holds them: does "
                f"your split drop the remainder ({len(NAMES)} params over {world_size} ranks)?")
    if stale and stale == wrong:
        return (f"{name_list(stale)} still at their initial values here, updated only by their "
                "owner: broadcast each updated shard from its owner after step()")
    if no_decay and sorted(wrong) == sorted(no_decay):
        return (f"only the weight_decay=0.0 group differs ({name_list(wrong)}): weight decay "
                "applied to it? keep each param group's options in your shard")
    return f"{len(wrong)} of {len(NAMES)} params differ, worst first: {name_list(wrong)}"


def make_params_check(optimizer_spec, grouped):
    def check_params(ctx):
        params, opt = train_learner(ctx, optimizer_spec, grouped, NUM_STEPS)
        reference, _ = train_reference(optimizer_spec, grouped, NUM_STEPS)
        owners = {name: [] for name in NAMES}
        for rank, names in enumerate(ctx.gather(owned_names(ctx, opt, params))):
            for name in names:
                owners[name].append(rank)
        got, want = dict(zip(NAMES, params)), dict(zip(NAMES, reference))
        diff, _ = max_abs_diff(got, want)
        if diff <= TOL:
            return passed(diff=diff)
        wrong = sorted(differing(got, want), key=lambda n: -max_abs_diff(
            {n: got[n]}, {n: want[n]})[0])
        initial = dict(zip(NAMES, build_params()))
        return failed(explain_params(wrong, got, initial, owners,
                                     NO_DECAY if grouped else [], ctx.world_size), diff)
    return check_params


def check_ownership(ctx):
    params, opt = train_learner(ctx, ADAMW, True, 1)
    owners = {name: [] for name in NAMES}
    for rank, names in enumerate(ctx.gather(owned_names(ctx, opt, params))):
        for name in names:
            owners[name].append(rank)
    shared = [n for n in NAMES if len(owners[n]) > 1]
    orphans = [n for n in NAMES if not owners[n]]
    if len(shared) == len(NAMES) and all(len(owners[n]) == ctx.world_size for n in NAMES):
        return failed(f"every rank's optimizer holds all {len(NAMES)} params: every rank "
                      "updates the whole model (no sharding); build it over your shard only")
    if shared:
        return failed(f"{name_list(shared)} held by more than one rank: the shards overlap")
    if orphans:
        return failed(f"{name_list(orphans)} in no rank's optimizer: does your split drop "
                      f"the remainder ({len(NAMES)} params over {ctx.world_size} ranks)?")
    counts = [sum(r in owners[n] for n in NAMES) for r in range(ctx.world_size)]
    return passed(f"params per rank: {', '.join(map(str, counts))}")


def check_state_bytes(ctx):
    params, opt = train_learner(ctx, ADAMW, True, 2)
    _, full_optimizer = train_reference(ADAMW, True, 2)
    per_rank = ctx.gather(state_bytes(ctx.entry("local_optimizer")(opt)))
    full, total = state_bytes(full_optimizer), sum(per_rank)
    largest = max(state_bytes_of(full_optimizer, p) for p in full_optimizer.state)
    bound = full / ctx.world_size + largest
    shares = ", ".join(format_bytes(b) for b in per_rank)
    if total > full:
        return failed(f"the ranks hold {format_bytes(total)} of optimizer state together "
                      f"({shares}), {total / full:.2f}x one optimizer's {format_bytes(full)}: "
                      "state for more than your shard (no sharding?)")
    if total < full:
        return failed(f"the ranks hold {format_bytes(total)} together ({shares}), less than "
                      f"one optimizer's {format_bytes(full)}: some params have no state")
    heaviest = max(range(ctx.world_size), key=lambda r: per_rank[r])
    if per_rank[heaviest] > bound:
        return failed(f"rank {heaviest} holds {format_bytes(per_rank[heaviest])} of "
                      f"{format_bytes(full)} ({shares}); a balanced split holds at most "
                      f"{format_bytes(bound)}: give params, largest first, to the rank "
                      "holding the fewest elements so far")
    return passed(f"per rank {shares} of {format_bytes(full)}")


def state_bytes_of(optimizer, param):
    return sum(v.numel() * v.element_size() for v in optimizer.state[param].values()
               if torch.is_tensor(v))


def check_zero_grad(ctx):
    params, opt = train_learner(ctx, SGD, False, 1)
    mine = set(owned_names(ctx, opt, params))
    set_grads(params, NUM_STEPS)
    opt.zero_grad()
    left = [n for n, p in zip(NAMES, params) if p.grad is not None and p.grad.abs().max() > 0]
    if not left:
        return passed()
    whose = ("none of them in this rank's shard: zero every parameter's grad, not only your "
             "shard's" if not mine & set(left) else "set each .grad to None (or zero it)")
    return failed(f"{len(left)} of {len(NAMES)} params still have a gradient after "
                  f"zero_grad() ({name_list(left)}), {whose}")


EXERCISE = Exercise(
    name="zero1",
    stub="zero1.py",
    entry_points=("make_zero1", "local_optimizer"),
    checks=(
        Check("params equal one process (AdamW, no decay on 1-D)", make_params_check(ADAMW, True)),
        Check("params equal one process (SGD, momentum)", make_params_check(SGD, False)),
        Check("each param in exactly one rank's optimizer", check_ownership),
        Check("optimizer state split across ranks (bytes)", check_state_bytes),
        Check("zero_grad clears every param's grad", check_zero_grad),
        Check("params equal one process, 3 ranks (uneven split)", make_params_check(ADAMW, True),
              3),
        Check("each param in exactly one rank's optimizer, 3 ranks", check_ownership, 3),
        Check("optimizer state split across 3 ranks (bytes)", check_state_bytes, 3),
    ),
    # torch.optim's first step() imports torch._dynamo (about 1 s): once, before forking.
    preload=("torch._dynamo",),
)
