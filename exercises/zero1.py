"""Exercise 2: a ZeRO-1 sharded optimizer. Split the optimizer state across ranks.

Grade it (the grader starts its own ranks, 2 and then 3, on gloo; plain python, not torchrun):
    python exercises/grade.py zero1

Why: with AdamW, the optimizer state (exp_avg and exp_avg_sq) takes twice the parameters'
bytes, on every rank, all identical. ZeRO stage 1 keeps the whole model on every rank but
gives each rank the state for only its shard of the parameters: each rank updates its shard,
then the updated parameters are sent to every rank. The state memory per rank drops to about
1/world_size, for one broadcast (or all-gather) of the parameters per step.

What to build: a class that wraps any torch.optim optimizer class.
  1. Construction: decide which rank owns each parameter (the rule below); build ONE inner
     optimizer_class over only your parameters, keeping each parameter's group options.
  2. step(): the inner optimizer updates your shard; then every parameter reaches every rank
     from the rank that owns it (dist.broadcast(param, src=owner), or an all-gather).
  3. zero_grad(): clears the gradient of every parameter, not only your shard's.

The contract (what the grader calls, when, and what must hold):
  - The default process group is initialised (gloo, CPU; 2 ranks, then 3) before anything
    here runs. Every rank has the same parameters with the same values.
  - Each rank calls
        opt = make_zero1(params, optimizer_class, **defaults)
    params: a list of Parameters, or a list of param-group dicts such as
    [{"params": weights}, {"params": biases, "weight_decay": 0.0}]; an option a group leaves
    out comes from defaults, as in torch.optim. optimizer_class: a torch.optim.Optimizer
    subclass (the grader uses AdamW with weight decay, and SGD with momentum).
  - Sharding rule: whole parameters, never split. Go through the parameters largest first
    (by numel; ties: the one that comes first in params), and give each to the rank that
    holds the fewest elements so far (ties: the lowest rank). The grader accepts any split
    where each parameter is owned by exactly one rank and no rank holds more than
    total/world_size + the largest parameter (elements); this rule always meets that.
    world_size is at most the number of parameters (every rank owns at least one).
  - Each step, on every rank: the grader sets every param.grad (identical on every rank, as
    after DDP), then calls opt.step(). After it returns, every parameter on every rank
    equals what one optimizer_class over all the parameters computes from the same
    gradients (fp32, within 1e-5).
  - opt.zero_grad(): afterwards every parameter's .grad is None (or zero), on every rank.
  - local_optimizer(opt) returns this rank's inner torch.optim.Optimizer. The grader reads
    its param_groups (which parameters you own: the very Parameter objects you were given,
    not copies) and its state (bytes of optimizer state). The state of all ranks together
    must equal one plain optimizer's: no parameter's state on two ranks.
  - No state_dict / load_state_dict: saving a sharded optimizer is not part of this exercise.

The adapter: the grader calls only the two module-level names at the end of this file,
make_zero1(params, optimizer_class, **defaults) -> an object with step() and zero_grad(),
and local_optimizer(opt) -> the inner optimizer. Your class may have any names: point the
two at your own code, e.g.
    make_zero1 = MyShardedOptimizer
    def local_optimizer(opt):
        return opt.inner

Lesson: lessons/02_fsdp.py (ZeRO stages). A solution: exercises/solutions/zero1.py (try first).
"""

import torch
import torch.distributed as dist


def assign_owners(params, world_size):
    """The owning rank of each parameter (a list as long as params), by the sharding rule."""
    raise NotImplementedError(
        "implement assign_owners: largest first, each to the rank holding the fewest elements")


class ZeroOneOptimizer:
    """Wraps optimizer_class: every rank steps only its shard, then shares the result."""

    def __init__(self, params, optimizer_class, **defaults):
        raise NotImplementedError(
            "implement ZeroOneOptimizer.__init__: read the param groups, assign an owner to "
            "each parameter, build optimizer_class over your shard (keep group options)")

    def step(self):
        raise NotImplementedError(
            "implement ZeroOneOptimizer.step: step the inner optimizer, then broadcast each "
            "parameter from its owner")

    def zero_grad(self, set_to_none=True):
        raise NotImplementedError(
            "implement ZeroOneOptimizer.zero_grad: clear every parameter's .grad")


# The grader's entry points (the adapter). Keep these two names; point them at your code.
make_zero1 = ZeroOneOptimizer


def local_optimizer(opt):
    return opt.optimizer  # the inner optimizer, as your __init__ names it
