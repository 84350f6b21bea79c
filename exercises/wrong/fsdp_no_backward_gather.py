"""Keeps each unit gathered from its forward to its backward: no free, no second all-gather."""

import torch
import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shard_of(tensor, rank, world_size):
    k = -(-tensor.numel() // world_size)
    flat = torch.zeros(world_size * k, dtype=torch.float32)
    flat[:tensor.numel()] = tensor.detach().reshape(-1)
    return flat[rank * k:(rank + 1) * k].clone()


class HandFSDP(torch.nn.Module):
    def __init__(self, module, compute_dtype=None):
        super().__init__()
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.compute_dtype = compute_dtype or torch.float32
        self.names, self.params = map(list, zip(*module.named_parameters()))
        self.shards = [shard_of(p, self.rank, self.world_size).requires_grad_()
                       for p in self.params]
        self.shard_numels = [shard.numel() for shard in self.shards]
        for param in self.params:
            param.data = param.data.to(self.compute_dtype)
            param.untyped_storage().resize_(0)
            param.register_post_accumulate_grad_hook(self._grad_ready)
        self.num_ready = 0
        self.gathered = False

    def gather(self):
        send = torch.cat([shard.detach() for shard in self.shards]).to(self.compute_dtype)
        recv = torch.empty(self.world_size * send.numel(), dtype=self.compute_dtype)
        all_gather_flat(recv, send)
        columns = recv.view(self.world_size, -1).split(self.shard_numels, dim=1)
        for param, column in zip(self.params, columns):
            param.untyped_storage().resize_(param.numel() * param.element_size())
            param.data.copy_(column.reshape(-1)[:param.numel()].view(param.shape))
        self.gathered = True

    def free_params(self):
        for param in self.params:
            param.untyped_storage().resize_(0)
        self.gathered = False

    def forward(self, *args):
        self.gather()
        args = [a.to(self.compute_dtype) if torch.is_floating_point(a) else a for a in args]
        # THE MISTAKE: the full params stay from forward to backward (no free, no second
        # all-gather): right gradients, but every unit stays whole until backward reaches it.
        return self.module(*args)

    def _grad_ready(self, param):
        self.num_ready += 1
        if self.num_ready < len(self.params):
            return
        self.num_ready = 0
        self.reduce_scatter()
        self.free_params()

    def reduce_scatter(self):
        columns = []
        for param, k in zip(self.params, self.shard_numels):
            flat = torch.zeros(self.world_size * k, dtype=torch.float32)
            flat[:param.numel()] = param.grad.reshape(-1)
            columns.append(flat.view(self.world_size, k))
            param.grad = None
        send = torch.cat(columns, dim=1).reshape(-1)
        recv = torch.empty(send.numel() // self.world_size)
        reduce_scatter_flat(recv, send)
        recv /= self.world_size
        for shard, grad in zip(self.shards, recv.split(self.shard_numels)):
            shard.grad = grad.clone() if shard.grad is None else shard.grad + grad

    def full_state(self):
        send = torch.cat([shard.detach() for shard in self.shards])
        recv = torch.empty(self.world_size * send.numel())
        all_gather_flat(recv, send)
        columns = recv.view(self.world_size, -1).split(self.shard_numels, dim=1)
        return {name: column.reshape(-1)[:param.numel()].view(param.shape).clone()
                for name, param, column in zip(self.names, self.params, columns)}


make_fsdp = HandFSDP


def local_shards(unit):
    return dict(zip(unit.names, unit.shards))


def full_state(unit):
    return unit.full_state()
