"""Byte and layout probes: what each rank holds, measured from the tensors themselves, for the
lessons and tests that compare it with the formula. They attach from outside, with hooks, so a
lab's training step holds no probe code."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from labkit.metrics import gather_per_rank


def held_bytes(tensors):
    """Bytes of the storage behind these tensors, each storage counted once: DTensors count
    their local shard, FSDP's padded shard storage counts with its padding, and gradients that
    are views into one reduce-scatter output count that buffer once."""
    storages = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def measure_state_bytes(model, optimizer):
    """This rank's persistent training state, measured from the tensors it holds."""
    local_optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps one
    states = [v for state in local_optimizer.state.values() for v in state.values()
              if torch.is_tensor(v)]
    return {"params": held_bytes(p for p in model.parameters()),
            "grads": held_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": held_bytes(states)}


def unsharded_param_bytes(model):
    """Bytes of parameters registered in full form right now. Between forward and backward
    this is what reshard_after_forward decides: the root only (true) or every block (false)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if not isinstance(p, DTensor))


class FirstStepBytes:
    """Measures the first training step that runs: the unsharded parameter bytes right after
    its first forward, and the state bytes right after optimizer.step() (before zero_grad
    frees the gradients). Then its hooks remove themselves. Its values are per rank. A step
    with no forward before it (the fake one get_state_dict() takes to create optimizer state)
    is not measured, and neither is one that fp16's GradScaler skips (it never calls step)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.values = model, optimizer, {}
        # Registered after fully_shard, so it runs after FSDP's own post-forward hook.
        self.hooks = [model.register_forward_hook(self.after_forward),
                      optimizer.register_step_post_hook(self.after_step)]

    def after_forward(self, module, args, output):
        self.values.setdefault("unsharded_after_forward", unsharded_param_bytes(module))

    def after_step(self, optimizer, args, kwargs):
        if "unsharded_after_forward" not in self.values:
            return  # not a training step
        self.values.update(measure_state_bytes(self.model, self.optimizer))
        for hook in self.hooks:
            hook.remove()

    def report(self, world_size):
        """Every rank's values, gathered (a collective: every rank calls it)."""
        per_rank = gather_per_rank({k: self.values.get(k) for k in
                                    ("params", "grads", "optimizer", "unsharded_after_forward")},
                                   world_size)
        return {"state_bytes_per_rank": {k: per_rank[k] for k in ("params", "grads", "optimizer")},
                "unsharded_param_bytes_after_forward": per_rank["unsharded_after_forward"]}


def layout_report(model):
    """{name: [placements, global shape, local shape on each rank]} of a model of DTensors,
    gathered to every rank (a collective)."""
    mine = {name: [str(tuple(p.placements)), list(p.shape), list(p.to_local().shape)]
            for name, p in model.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {name: [*mine[name][:2], [g[name][2] for g in gathered]] for name in mine}

