"""Uneven split mishandled: len(params) // world_size params per rank; the rest get no owner."""

import torch
import torch.distributed as dist


class ZeroOneOptimizer:
    def __init__(self, params, optimizer_class, **defaults):
        groups = list(params)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**group, "params": list(group["params"])} for group in groups]
        self.params = [p for group in groups for p in group["params"]]
        world_size, rank = dist.get_world_size(), dist.get_rank()
        # THE MISTAKE: 8 parameters over 3 ranks gives 2 each; parameters 6 and 7 fall off the
        # end. (The clamp below keeps the broadcast legal, so nothing crashes.)
        per_rank = len(self.params) // world_size
        self.owners = [min(i // per_rank, world_size - 1) for i in range(len(self.params))]
        mine = {id(p) for p in self.params[rank * per_rank:(rank + 1) * per_rank]}
        shard = [{**group, "params": [p for p in group["params"] if id(p) in mine]}
                 for group in groups]
        self.optimizer = optimizer_class([g for g in shard if g["params"]], **defaults)

    def step(self):
        self.optimizer.step()
        with torch.no_grad():
            for param, owner in zip(self.params, self.owners):
                dist.broadcast(param, src=owner)

    def zero_grad(self, set_to_none=True):
        for param in self.params:
            param.grad = None


make_zero1 = ZeroOneOptimizer


def local_optimizer(opt):
    return opt.optimizer
