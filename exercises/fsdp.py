"""Exercise 3: FSDP by hand. Shard every parameter; make a unit whole only while it computes.

Grade it (the grader starts its own ranks, 2 and then 3, on gloo; plain python, not torchrun):
    python exercises/grade.py fsdp

Why: ZeRO-1 (exercise 2) splits the optimizer state, but every rank still holds the whole
model and its whole gradient. FSDP (ZeRO-3) keeps on each rank only a 1/world_size shard of
every parameter, of its gradient and of its optimizer state. A unit (here, one block of the
model) is made whole by an all-gather just before it computes and freed right after; backward
gathers it again, and its gradients are reduce-scattered: each rank receives the sum over
ranks of its own shard's slice only. Per unit and step: 2 all-gathers and 1 reduce-scatter,
and the full parameters of about one unit at a time.

What to build: a wrapper around one module (a unit).
  1. Construction: cut each parameter into this rank's shard (the rule below), a new fp32
     tensor that requires grad (the master shard the optimizer updates); free the module's
     full parameters.
  2. Forward: all-gather the unit's shards, fill the module's parameters, run the module,
     free the parameters; register a hook on the output (Tensor.register_hook), which fires
     when backward reaches this unit.
  3. Backward: that hook all-gathers again (autograd needs the parameters to compute the
     gradients). When every parameter of the unit has its full gradient
     (Tensor.register_post_accumulate_grad_hook), reduce-scatter them, divide by world_size,
     put each rank's slice in its shard's .grad; drop the full gradients, free the params.

The contract (what the grader calls, when, and what must hold):
  - The default process group is initialised (gloo, CPU; 2 ranks, then 3) before anything
    here runs. Every rank builds the same model with the same values (no broadcast needed).
  - The grader wraps each block of its model (a stem, two residual blocks, a head):
        unit = make_fsdp(block, compute_dtype=None)
    and runs the units in order, x = unit(x) (called like the block; one tensor in, one out),
    on this rank's equal slice of the global batch, then loss.backward(). Each unit runs
    forward once per step, then backward once. No parameter is shared between blocks; every
    parameter requires grad and gets a gradient every step.
  - Sharding rule, per parameter: flatten it (p.reshape(-1)) and pad it with zeros at the end
    to world_size * k elements, k = ceil(numel / world_size); rank r keeps elements
    [r*k, (r+1)*k), padding included: a 1-D fp32 tensor of k elements. E.g. a bias of 10 at
    3 ranks: k = 4; rank 0 keeps elements 0-3, rank 1 4-7, rank 2 8, 9 and two zeros.
  - local_shards(unit) -> {name: shard}, names as in block.named_parameters(). These very
    tensors (leaves, requires_grad=True), not copies: the grader's SGD updates them in place
    between steps, and the next forward must gather the updated values.
  - The full parameters: keep the block's own Parameter objects in place (same objects, names
    and shapes): they are what the block computes with. Between uses they are freed: their
    storage holds 0 bytes (p.untyped_storage().resize_(0), which is what FSDP does; the tensor
    keeps its shape). Before a use, give the storage its size back
    (resize_(p.numel() * p.element_size())) and fill it through p.data (p.data.copy_(...)):
    autograd saved p in forward and checks p's version counter in backward, which p.copy_
    would bump ("modified by an inplace operation").
  - Freed, precisely (the grader looks after every forward and every backward, and during the
    next unit's forward): every Parameter of a unit that is not computing has a storage of
    0 bytes; after backward its .grad is None (the gradient lives in the shard's .grad); and
    every tensor an all-gather of yours wrote into is released or has a storage of 0 bytes.
    While a block computes (forward, and its backward) its parameters hold the current values.
  - Communication per unit and step: ONE all-gather before forward and ONE during backward,
    each of all the unit's shards together (rank r's shards end to end), and ONE
    reduce-scatter during backward, from the gradient hooks (not after backward). Use
    dist.all_gather_single and dist.reduce_scatter_single (the flat forms, as torch 2.13
    names them; before 2.13, dist.all_gather_into_tensor and dist.reduce_scatter_tensor).
    The grader counts the calls of all four and of the list forms dist.all_gather and
    dist.reduce_scatter.
  - Gradients: after loss.backward() returns, each shard's .grad holds elements
    [r*k, (r+1)*k) of the padded flat gradient of the loss on the whole global batch: the
    sum over ranks divided by world_size (fp32, within 1e-5 of one process); padding stays
    zero. The grader sets every shard's .grad to None before each step.
  - compute_dtype: None (fp32) or torch.bfloat16. With bf16 the block computes in bf16 and the
    master shards stay fp32 (FSDP2's MixedPrecisionPolicy with param_dtype=bf16,
    reduce_dtype=fp32): convert the block's Parameters to bf16 at construction
    (p.data = p.data.to(bf16)); cast your fp32 shards to bf16 before the all-gather (half the
    bytes); cast the unit's floating-point input to bf16 before calling the block; upcast the
    bf16 gradients to fp32 before the reduce-scatter, so the shards' .grad are fp32. Checked
    against one process doing the same casting on the whole batch, within 5% of the largest
    gradient (bf16 keeps 8 significant bits: the grader's comment has the numbers).
  - full_state(unit) -> {name: full fp32 tensor, the parameter's shape}, assembled from every
    rank's shard (a collective: every rank calls it; the grader does not count it).

The adapter: the grader calls only the three module-level names at the end of this file,
make_fsdp(module, compute_dtype=None) -> unit (called like the module),
local_shards(unit) -> {name: shard} and full_state(unit) -> {name: full tensor}. Your class
and methods may have any names: point the three at your own code, e.g.
    make_fsdp = MyUnit
    def local_shards(unit):
        return dict(zip(unit.names, unit.shards))

Lesson: lessons/02_fsdp.py (shard_by_hand_vs_fully_shard in lessons/fsdp_workers.py does it
for one layer). A solution: exercises/solutions/fsdp.py (try first).
"""

import torch
import torch.distributed as dist


def shard_of(tensor, rank, world_size):
    """Elements [rank * k, (rank + 1) * k) of tensor, flattened and zero-padded to
    world_size * k, k = ceil(numel / world_size): a new 1-D fp32 tensor of k elements."""
    raise NotImplementedError(
        "implement shard_of: flatten, zero-pad to world_size * k, keep this rank's k elements")


class HandFSDP(torch.nn.Module):
    """One unit: `module`'s parameters sharded over ranks, whole only while it computes."""

    def __init__(self, module, compute_dtype=None):
        super().__init__()
        self.module = module
        raise NotImplementedError(
            "implement HandFSDP.__init__: keep this rank's fp32 shard of each parameter (as "
            "self.shards, names in self.names), free the module's parameters, register a "
            "post-accumulate-grad hook on each")

    def gather(self):
        """ONE all-gather of every shard of the unit; refill the module's parameters."""
        raise NotImplementedError(
            "implement HandFSDP.gather: dist.all_gather_single of your shards end to end, "
            "then copy each parameter's columns into its storage through p.data")

    def free_params(self):
        raise NotImplementedError(
            "implement HandFSDP.free_params: p.untyped_storage().resize_(0) for each param")

    def forward(self, *args):
        raise NotImplementedError(
            "implement HandFSDP.forward: gather, run the module, free, hook the output so "
            "backward gathers again")

    def _before_backward(self, grad):
        """Hook on the forward's output: backward has reached this unit."""
        raise NotImplementedError(
            "implement HandFSDP._before_backward: gather the params again (once per backward)")

    def _grad_ready(self, param):
        """Post-accumulate-grad hook: param.grad is the full gradient of this rank's batch."""
        raise NotImplementedError(
            "implement HandFSDP._grad_ready: count; when the unit's last parameter is ready, "
            "reduce_scatter, then free the params")

    def reduce_scatter(self):
        """Called from the gradient hooks once every parameter of the unit has its gradient."""
        raise NotImplementedError(
            "implement HandFSDP.reduce_scatter: one dist.reduce_scatter_single of the padded "
            "full grads, divided by world_size, into each shard's .grad; drop the full grads")

    def full_state(self):
        raise NotImplementedError(
            "implement HandFSDP.full_state: all-gather the fp32 shards, unpad, reshape")


# The grader's entry points (the adapter). Keep these three names; point them at your code.
make_fsdp = HandFSDP


def local_shards(unit):
    return dict(zip(unit.names, unit.shards))  # the shards, as your __init__ names them


def full_state(unit):
    return unit.full_state()
