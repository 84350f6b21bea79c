"""No sharding: every rank's optimizer holds all the parameters and updates the whole model."""

import torch
import torch.distributed as dist


class ZeroOneOptimizer:
    def __init__(self, params, optimizer_class, **defaults):
        groups = list(params)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**group, "params": list(group["params"])} for group in groups]
        self.params = [p for group in groups for p in group["params"]]
        # THE MISTAKE: the inner optimizer gets every group, whole. The parameters come out
        # right (every rank has the same gradients), but each rank holds the full state.
        self.optimizer = optimizer_class(groups, **defaults)

    def step(self):
        self.optimizer.step()
        with torch.no_grad():
            for param in self.params:
                dist.broadcast(param, src=0)

    def zero_grad(self, set_to_none=True):
        for param in self.params:
            param.grad = None


make_zero1 = ZeroOneOptimizer


def local_optimizer(opt):
    return opt.optimizer
