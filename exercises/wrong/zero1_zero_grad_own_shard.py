"""zero_grad clears only this rank's shard (the inner optimizer's), not every parameter."""

import torch
import torch.distributed as dist


def assign_owners(params, world_size):
    """Rank owning each parameter: largest first (ties: the earlier one), each to the rank
    holding the fewest elements so far (ties: the lowest rank). No rank ends up holding more
    than total / world_size + the largest parameter."""
    load = [0] * world_size
    owners = [None] * len(params)
    for index in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        rank = min(range(world_size), key=lambda r: load[r])
        owners[index] = rank
        load[rank] += params[index].numel()
    return owners


class ZeroOneOptimizer:
    def __init__(self, params, optimizer_class, **defaults):
        groups = list(params)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**group, "params": list(group["params"])} for group in groups]
        self.params = [p for group in groups for p in group["params"]]
        self.owners = assign_owners(self.params, dist.get_world_size())
        rank = dist.get_rank()
        mine = {id(p) for p, owner in zip(self.params, self.owners) if owner == rank}
        # Keep each group's own options (weight_decay=0.0 for biases, ...), restricted to
        # this rank's parameters; a group with none of them is left out.
        shard = [{**group, "params": [p for p in group["params"] if id(p) in mine]}
                 for group in groups]
        shard = [group for group in shard if group["params"]]
        # The optimizer state (AdamW: exp_avg and exp_avg_sq, 2x the parameters' bytes) now
        # exists for this rank's shard only: the whole point of ZeRO-1.
        self.optimizer = optimizer_class(shard, **defaults)

    def step(self):
        self.optimizer.step()  # every rank has the whole (averaged) gradient: use its shard
        # Each parameter from the rank that just updated it: one broadcast per parameter.
        # (An all-gather of flat shards does the same in one collective; this is the plain form.)
        with torch.no_grad():
            for param, owner in zip(self.params, self.owners):
                dist.broadcast(param, src=owner)

    def zero_grad(self, set_to_none=True):
        # THE MISTAKE: the inner optimizer knows only this rank's parameters.
        self.optimizer.zero_grad(set_to_none=set_to_none)


# The grader's entry points (the adapter): see exercises/zero1.py.
make_zero1 = ZeroOneOptimizer


def local_optimizer(sharded):
    return sharded.optimizer
