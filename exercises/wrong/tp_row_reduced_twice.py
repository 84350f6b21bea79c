"""Row-parallel g all-reduces in backward too: its gradients come out world_size times too big."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


class CopyToTP(torch.autograd.Function):
    """f: every rank has the whole input."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # autograd may hand the same tensor to another consumer
        dist.all_reduce(grad)  # SUM: each rank's output slice contributed a part of dL/dx
        return grad


class ReduceFromTP(torch.autograd.Function):
    """g: the partial sums of a row-parallel layer become the whole output on every rank."""

    @staticmethod
    def forward(ctx, partial):
        out = partial.clone()
        dist.all_reduce(out)  # SUM, not AVG: y = sum over ranks of x_r W_r^T
        return out

    @staticmethod
    def backward(ctx, grad):
        # THE MISTAKE: "a collective's backward is the same collective", but every rank
        # already holds dL/dy whole: summing it over ranks scales it by world_size.
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def my_slice(tensor, dim):
    """This rank's contiguous 1/world_size of `tensor` along `dim`, as a new Parameter."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if tensor.shape[dim] % world_size:
        raise ValueError(f"dim {dim} of {list(tensor.shape)} does not split into "
                         f"{world_size} equal slices")
    size = tensor.shape[dim] // world_size
    return torch.nn.Parameter(tensor.narrow(dim, rank * size, size).detach().clone())


class ColumnParallelLinear(torch.nn.Module):
    """y_r = x W_r^T + b_r: weight [out, in] keeps rows (output features) of this rank."""

    def __init__(self, weight, bias=None, copy_input=True):
        super().__init__()
        self.weight = my_slice(weight, 0)
        self.bias = my_slice(bias, 0) if bias is not None else None
        self.copy_input = copy_input  # False when the caller applied f already (attention)

    def forward(self, x):
        if self.copy_input:
            x = CopyToTP.apply(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    """y = sum_r x_r W_r^T + b: weight [out, in] keeps columns (input features); bias whole."""

    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight = my_slice(weight, 1)
        self.bias = torch.nn.Parameter(bias.detach().clone()) if bias is not None else None

    def forward(self, x):
        y = ReduceFromTP.apply(F.linear(x, self.weight))
        # After the all-reduce: added before it, the bias would count world_size times.
        return y + self.bias if self.bias is not None else y


class ParallelMLP(torch.nn.Module):
    """fc2(gelu(fc1(x))): gelu is elementwise, so the hidden slice never leaves its rank."""

    def __init__(self, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
        super().__init__()
        self.fc1 = ColumnParallelLinear(fc1_weight, fc1_bias)
        self.fc2 = RowParallelLinear(fc2_weight, fc2_bias)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelAttention(torch.nn.Module):
    """Heads split across ranks: q, k, v column-parallel (a block of whole heads each), the
    output projection row-parallel. One f for the three projections: one all-reduce backward."""

    def __init__(self, wq, wk, wv, wo, num_heads):
        super().__init__()
        world_size = dist.get_world_size()
        if num_heads % world_size:
            raise ValueError(f"{num_heads} heads do not split over {world_size} ranks")
        self.head_dim = wq.shape[0] // num_heads
        self.wq, self.wk, self.wv = (ColumnParallelLinear(w, copy_input=False)
                                     for w in (wq, wk, wv))
        self.wo = RowParallelLinear(wo)

    def forward(self, x):
        batch, seq, _ = x.shape
        x = CopyToTP.apply(x)  # once: x's gradient is summed over q, k, v locally, then ranks

        def heads(linear):  # [batch, local heads, seq, head_dim]
            return linear(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.wq), heads(self.wk), heads(self.wv),
                                           is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


# The grader's entry points (the adapter): see exercises/tp.py.
make_column = ColumnParallelLinear
make_row = RowParallelLinear
make_mlp = ParallelMLP
make_attention = ParallelAttention


def local_params(module):
    return dict(module.named_parameters())
