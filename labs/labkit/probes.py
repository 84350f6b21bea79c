"""Probes: what each rank holds and what one step costs it, measured from the tensors and
the collectives themselves, for the lessons and tests that compare them with the formula. They
attach from outside (hooks, or a context the kit's loop runs the first step in), so a lab's
training step holds no probe code."""

import contextlib
import warnings
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

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
    frees the gradients). Its values are per rank. A step
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
        if "unsharded_after_forward" not in self.values or "params" in self.values:
            return  # not a training step, or not the first
        # The hooks stay until report(): removing one while torch iterates over the hooks
        # would break the iteration for any hook registered after it.
        self.values.update(measure_state_bytes(self.model, self.optimizer))

    def report(self, world_size):
        """Every rank's values, gathered (a collective: every rank calls it)."""
        for hook in self.hooks:
            hook.remove()
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



class CommCounter(CommDebugMode):
    """CommDebugMode counts collectives by type (and per module); this also counts the bytes
    each rank sends for them, with lesson 00's ring factors for a group of n ranks and a full
    tensor of S bytes (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter:
    the unreduced input): all-reduce 2 (n-1)/n x S, all-gather and reduce-scatter (n-1)/n x S.
    TP's collectives come from DTensor as c10d_functional.* ops, which see only the local
    input (for an all-gather: one shard, S / n); FSDP's and the loss average come as c10d.*
    ops, which see both buffers. Counting wire bytes, not "the largest argument", is what
    makes the two comparable."""

    def __init__(self, groups):
        """groups: {label: ProcessGroup}, every group the step may use (a mesh axis each)."""
        super().__init__()
        self.groups = {g.group_name: (label, g.size()) for label, g in groups.items()}
        self.wire_bytes = Counter()           # by op
        self.wire_bytes_by_group = Counter()  # by (group label, op)
        self._quiet = warnings.catch_warnings()

    def __enter__(self):
        # CommDebugMode tracks modules with a global full-backward pre-hook, which wraps each
        # module's outputs in a view: FSDP2 then warns that its root "returned a view tensor",
        # and torch that the hook fires "with respect to module outputs" (the token ids need no
        # gradient). Both come from the instrument, not the training step: keep them out of
        # the output of the runs that count bytes.
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        warnings.filterwarnings("ignore", message=r"Full backward hook is firing when gradients")
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._quiet.__exit__(*exc)

    def group_of(self, args):
        for a in args:
            if isinstance(a, str) and a in self.groups:  # functional: the group's name
                return self.groups[a]
            if isinstance(a, torch.ScriptObject):  # c10d: the ProcessGroup itself
                with contextlib.suppress(RuntimeError):  # (the ReduceOp is one too)
                    return self.groups[dist.ProcessGroup.unbox(a).group_name]
        raise ValueError(f"none of the groups given is among the arguments: {args}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = Counter(self.comm_counts)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for op in Counter(self.comm_counts) - before:
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            (label, n), largest, name = self.group_of(args), max(t.nbytes for t in tensors), str(op)
            if "all_reduce" in name or "allreduce" in name:
                sent = 2 * (n - 1) / n * largest
            elif name == "c10d_functional.all_gather_into_tensor":  # its input is one shard
                sent = (n - 1) * largest
            elif "gather" in name or "scatter" in name:
                sent = (n - 1) / n * largest
            else:
                sent = largest
            self.wire_bytes[name] += int(sent)
            self.wire_bytes_by_group[f"{label} {name}"] += int(sent)
        return out

    def block_counts(self, block_name):
        found = [v for k, v in self.comm_module_counts.items() if k.endswith(block_name)]
        assert len(found) == 1, (block_name, list(self.comm_module_counts))
        return {phase: {str(op): n for op, n in found[0][phase].items()}
                for phase in ("forward", "backward")}


class SavedActivationBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd keeps for backward on this rank (storages counted once; parameters and
    their views excluded): the activation memory that TP and SP divide. counting(): whether
    a tensor saved now counts (default: always)."""

    def __init__(self, model, counting=lambda: True):
        self.total, seen = 0, set()

        def storage_key(tensor):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            try:
                storage = local.untyped_storage()
                return storage.data_ptr(), storage.nbytes()
            except RuntimeError:  # a wrapper (an in-flight collective's result) has no storage
                return id(local), local.nbytes

        def pack(tensor):
            key, nbytes = storage_key(tensor)
            if (counting() and key not in seen
                    and key not in {storage_key(p)[0] for p in model.parameters()}):
                seen.add(key)
                self.total += nbytes
            return tensor

        super().__init__(pack, lambda tensor: tensor)


class StepCosts:
    """--count-comms: the context the kit's loop runs the first step in (train_loop's
    first_step_probe). It counts that step's collectives by type, by mesh axis and per block
    (CommCounter), and the activation bytes the first micro-batch saves for backward
    (SavedActivationBytes). A no-op without --count-comms."""

    def __init__(self, cfg, model, mesh):
        self.enabled, self.model, self.values = cfg.count_comms, model, {}
        self.groups = ({name: mesh.get_group(name) for name in mesh.mesh_dim_names}
                       if self.enabled else {})

    @contextlib.contextmanager
    def _measure(self):
        counter = CommCounter({**self.groups, "world": dist.group.WORLD})
        forwards = Counter()  # micro-batches started: only the first one's saved bytes count
        hook = self.model.register_forward_pre_hook(lambda *_: forwards.update(["model"]))
        saved = SavedActivationBytes(self.model, counting=lambda: forwards["model"] <= 1)
        try:
            with counter, saved:
                yield
        finally:
            hook.remove()
        self.values = {
            "activation_bytes": saved.total,
            "comm_counts_per_step": {str(op): n for op, n in counter.comm_counts.items()},
            "comm_wire_bytes_per_step": dict(counter.wire_bytes),
            "comm_wire_bytes_per_step_by_group": dict(counter.wire_bytes_by_group),
            "comm_counts_block0": counter.block_counts("layers.0")}

    def __enter__(self):
        self._context = self._measure() if self.enabled else contextlib.nullcontext()
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)

    def report(self, world_size):
        """The metrics fields (a collective when enabled: every rank calls it)."""
        if not self.enabled:
            return {}
        activations = gather_per_rank({"bytes": self.values.pop("activation_bytes")}, world_size)
        return {"activation_bytes_per_rank": activations["bytes"], **self.values}
