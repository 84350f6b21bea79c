"""Reference solution: try exercises/fsdp.py first; read this after the grader has had its say.

FSDP by hand: each rank keeps a 1/world_size shard of every parameter (flattened, zero-padded);
a unit's full parameters exist only while it computes: all-gathered before its forward and
again before its backward, freed after each; its gradients are reduce-scattered from the
gradient hooks, so each rank receives only its shard's slice, averaged over ranks. The
contract is in exercises/fsdp.py.

    python exercises/grade.py fsdp exercises/solutions/fsdp.py
"""

import torch
import torch.distributed as dist

# The flat collectives FSDP uses: all_gather_single and reduce_scatter_single from torch 2.13,
# all_gather_into_tensor and reduce_scatter_tensor before (2.13 still takes those, with a
# FutureWarning). Lesson 00 shows both.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shard_size(numel, world_size):
    """k: elements per rank, ceil(numel / world_size); the last rank's tail is padding."""
    return -(-numel // world_size)


def shard_of(tensor, rank, world_size):
    """Elements [rank * k, (rank + 1) * k) of tensor, flattened and zero-padded to
    world_size * k: a new 1-D fp32 tensor of k elements."""
    k = shard_size(tensor.numel(), world_size)
    flat = torch.zeros(world_size * k, dtype=torch.float32)
    flat[:tensor.numel()] = tensor.detach().reshape(-1)
    return flat[rank * k:(rank + 1) * k].clone()


def free(param):
    """Drop param's data, keep the tensor (and its shape): autograd holds on to it."""
    param.untyped_storage().resize_(0)


class HandFSDP(torch.nn.Module):
    """One unit: `module`'s parameters sharded over ranks, whole only while it computes."""

    def __init__(self, module, compute_dtype=None):
        super().__init__()
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.compute_dtype = compute_dtype or torch.float32
        self.names, self.params = map(list, zip(*module.named_parameters()))
        # The fp32 master shards: what the optimizer updates, and all this rank keeps.
        # A plain list: they are not the module's parameters (module.parameters() stays the
        # full ones, which is what the block computes with).
        self.shards = [shard_of(p, self.rank, self.world_size).requires_grad_()
                       for p in self.params]
        self.shard_numels = [shard.numel() for shard in self.shards]
        for param in self.params:
            # Same Parameter object, now in the compute dtype; its data goes at once.
            param.data = param.data.to(self.compute_dtype)
            free(param)
            param.register_post_accumulate_grad_hook(self._grad_ready)
        self.num_ready = 0  # parameters whose full gradient backward has produced this step
        self.gathered = False

    def gather(self):
        """ONE all-gather for the unit: rank r's shards of every parameter, end to end."""
        send = torch.cat([shard.detach() for shard in self.shards]).to(self.compute_dtype)
        recv = torch.empty(self.world_size * send.numel(), dtype=self.compute_dtype)
        all_gather_flat(recv, send)
        # recv is (world_size, K): row r is rank r's shards; the columns of one parameter,
        # read row after row, are its padded flat form.
        columns = recv.view(self.world_size, -1).split(self.shard_numels, dim=1)
        for param, column in zip(self.params, columns):
            param.untyped_storage().resize_(param.numel() * param.element_size())
            # Through .data: in backward, autograd checks the version counter of the p it saved
            # in forward; param.copy_ would bump it ("modified by an inplace operation").
            param.data.copy_(column.reshape(-1)[:param.numel()].view(param.shape))
        self.gathered = True

    def free_params(self):
        for param in self.params:
            free(param)
        self.gathered = False

    def forward(self, *args):
        self.gather()
        # As FSDP2's MixedPrecisionPolicy: the block's inputs in the dtype it computes in.
        args = [a.to(self.compute_dtype) if torch.is_floating_point(a) else a for a in args]
        out = self.module(*args)
        self.free_params()  # autograd's saved references to the params now point at 0 bytes
        if out.requires_grad:
            # Fires when backward reaches this unit, before any of its ops runs backward.
            out.register_hook(self._before_backward)
        return out

    def _before_backward(self, grad):
        if not self.gathered:
            self.gather()  # the same storage autograd saved: refilled, not replaced

    def _grad_ready(self, param):
        """Gradient hook. When the unit's last parameter has its gradient, every op of the
        unit has run backward: reduce-scatter, then free the params and full gradients."""
        self.num_ready += 1
        if self.num_ready < len(self.params):
            return
        self.num_ready = 0
        self.reduce_scatter()
        self.free_params()

    def reduce_scatter(self):
        """ONE reduce-scatter for the unit, in fp32: the same (world_size, K) layout as the
        all-gather, so rank r receives the sum over ranks of its own shards' slices."""
        columns = []
        for param, k in zip(self.params, self.shard_numels):
            flat = torch.zeros(self.world_size * k, dtype=torch.float32)
            flat[:param.numel()] = param.grad.reshape(-1)  # upcast from the compute dtype
            columns.append(flat.view(self.world_size, k))
            param.grad = None  # the full gradient is transient, like the full parameter
        send = torch.cat(columns, dim=1).reshape(-1)
        recv = torch.empty(send.numel() // self.world_size)
        reduce_scatter_flat(recv, send)
        recv /= self.world_size  # the sum over ranks -> the mean: the global batch's gradient
        for shard, grad in zip(self.shards, recv.split(self.shard_numels)):
            shard.grad = grad.clone() if shard.grad is None else shard.grad + grad

    def full_state(self):
        send = torch.cat([shard.detach() for shard in self.shards])
        recv = torch.empty(self.world_size * send.numel())
        all_gather_flat(recv, send)
        columns = recv.view(self.world_size, -1).split(self.shard_numels, dim=1)
        return {name: column.reshape(-1)[:param.numel()].view(param.shape).clone()
                for name, param, column in zip(self.names, self.params, columns)}


# The grader's entry points (the adapter): see exercises/fsdp.py.
make_fsdp = HandFSDP


def local_shards(unit):
    return dict(zip(unit.names, unit.shards))


def full_state(unit):
    return unit.full_state()
