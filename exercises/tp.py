"""Exercise 4: tensor parallel by hand. Write Megatron's column- and row-parallel layers.

Grade it (the grader starts its own 2 ranks on gloo; plain python, not torchrun):
    python exercises/grade.py tp

What to build: every rank holds a slice of each weight, and two autograd functions carry all
the communication (Megatron-LM, Shoeybi et al., arXiv:1909.08053):
  f = CopyToTP:     identity forward, all-reduce (SUM) of the gradient backward;
  g = ReduceFromTP: all-reduce (SUM) forward, identity backward.
  1. ColumnParallelLinear: keeps this rank's slice of the OUTPUT features; f before its
     matmul, because every rank's output slice contributes a part of dL/dx.
  2. RowParallelLinear: keeps this rank's slice of the INPUT features, takes the matching
     slice of the input, and g adds the ranks' partial sums.
  3. ParallelMLP: column then row, gelu in between: one all-reduce forward, one backward.
  4. ParallelAttention: heads split across ranks: q, k, v column-parallel, the output
     projection row-parallel; still one all-reduce forward and one backward.

The contract (what the grader calls, when, and what must hold):
  - The default process group is initialised (gloo, CPU, 2 ranks) before anything here runs.
    Every rank gets the same full tensors, fp32; weights are [out_features, in_features], as
    in nn.Linear (y = x @ weight.T + bias).
  - The split rule: world_size equal, contiguous slices; rank r keeps slice r.
    Column-parallel splits the output dim: rows r*out/ws .. (r+1)*out/ws - 1 of weight, and
    the same part of bias. Row-parallel splits the input dim: columns r*in/ws .. of weight;
    its bias is kept whole and added once, after the all-reduce. Keep each slice as an
    nn.Parameter of its own (a copy, not the full tensor).
  - layer = make_column(weight, bias); layer(x): x [..., in] (the same on every rank) ->
    this rank's slice of the output, [..., out/ws]. No gather.
  - layer = make_row(weight, bias); layer(x): x [..., in/ws] (this rank's slice of the
    input features) -> the whole output [..., out], the same on every rank.
  - block = make_mlp(fc1_weight, fc1_bias, fc2_weight, fc2_bias); block(x) =
    fc2(gelu(fc1(x))) (exact gelu, F.gelu), x and output whole [..., dim]. fc1 is
    column-parallel, fc2 row-parallel: the hidden activation stays split.
  - block = make_attention(wq, wk, wv, wo, num_heads); block(x): x [batch, seq, dim] ->
    [batch, seq, dim], no biases. Head h uses rows h*head_dim .. (h+1)*head_dim - 1 of wq,
    wk, wv's output dim and the same columns of wo (head_dim = dim // num_heads), so the
    column-parallel rule gives each rank num_heads/ws whole heads. Per head, causal
    attention: F.scaled_dot_product_attention(q, k, v, is_causal=True) with q, k, v shaped
    [batch, heads, seq, head_dim]; then the heads back side by side, [batch, seq, heads *
    head_dim], through wo (row-parallel). num_heads is divisible by world_size.
  - The grader calls backward on sum(output * upstream) with a fixed upstream gradient (for
    a column-parallel layer, the slice of it matching this rank's output). Afterwards each
    parameter's .grad equals this rank's slice of one process's gradient of the full weight,
    and x.grad equals one process's gradient of x (its slice, for make_row): fp32, within
    1e-5.
  - Communication: dist.all_reduce only, SUM, called as dist.all_reduce (the grader counts
    the calls, forward and backward apart). Per forward + backward: column 0 + 1, row 1 + 0,
    MLP 1 + 1, attention 1 + 1. Attention: apply f to x ONCE and give the copy to q, k and v
    (three f's would all-reduce three gradients that autograd can add up locally first).
  - local_params(module) returns {name: Parameter} for the grader to read your slices and
    their .grad: for make_column and make_row "weight", "bias"; for make_mlp "fc1.weight",
    "fc1.bias", "fc2.weight", "fc2.bias"; for make_attention "wq.weight", "wk.weight",
    "wv.weight", "wo.weight". With the attribute names below, module.named_parameters()
    gives exactly these.

The adapter: the grader calls only the module-level names at the end of this file:
make_column(weight, bias), make_row(weight, bias), make_mlp(fc1_weight, fc1_bias, fc2_weight,
fc2_bias), make_attention(wq, wk, wv, wo, num_heads), each returning a module called as
module(x), and local_params(module). Your classes may have any names: point these at them, e.g.
    make_mlp = MyMLP
    def local_params(module):
        return {"fc1.weight": module.up.w, ...}

Lesson: lessons/03_tp_fsdp.py (From scratch: column-parallel, then row-parallel) and
lessons/tp_workers.py. A solution: exercises/solutions/tp.py (try first).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


class CopyToTP(torch.autograd.Function):
    """f: identity forward; backward all-reduces (SUM) the input's gradient."""

    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError("implement CopyToTP.forward: return x unchanged")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(
            "implement CopyToTP.backward: dist.all_reduce a copy of grad (SUM), return it")


class ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduces (SUM) the partial sums; identity backward."""

    @staticmethod
    def forward(ctx, partial):
        raise NotImplementedError(
            "implement ReduceFromTP.forward: dist.all_reduce a copy of partial (SUM)")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("implement ReduceFromTP.backward: return grad unchanged")


class ColumnParallelLinear(torch.nn.Module):
    """Keeps rows (output features) of weight [out, in] and of bias; returns its output slice.
    copy_input=False: the caller applied f already (attention's q, k, v share one)."""

    def __init__(self, weight, bias=None, copy_input=True):
        super().__init__()
        raise NotImplementedError(
            "implement ColumnParallelLinear.__init__: keep this rank's rows of weight (and "
            "bias) as nn.Parameters named weight and bias")

    def forward(self, x):
        raise NotImplementedError(
            "implement ColumnParallelLinear.forward: f (CopyToTP) on x, then x @ weight.T + bias")


class RowParallelLinear(torch.nn.Module):
    """Keeps columns (input features) of weight [out, in] and the whole bias; x is sliced."""

    def __init__(self, weight, bias=None):
        super().__init__()
        raise NotImplementedError(
            "implement RowParallelLinear.__init__: keep this rank's columns of weight, the "
            "whole bias")

    def forward(self, x):
        raise NotImplementedError(
            "implement RowParallelLinear.forward: x @ weight.T, g (ReduceFromTP), then + bias")


class ParallelMLP(torch.nn.Module):
    """fc2(gelu(fc1(x))): fc1 column-parallel, fc2 row-parallel."""

    def __init__(self, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
        super().__init__()
        raise NotImplementedError(
            "implement ParallelMLP.__init__: self.fc1 column-parallel, self.fc2 row-parallel")

    def forward(self, x):
        raise NotImplementedError("implement ParallelMLP.forward: fc2(gelu(fc1(x)))")


class ParallelAttention(torch.nn.Module):
    """Heads split across ranks: self.wq, self.wk, self.wv column-parallel, self.wo row."""

    def __init__(self, wq, wk, wv, wo, num_heads):
        super().__init__()
        raise NotImplementedError(
            "implement ParallelAttention.__init__: wq, wk, wv column-parallel (whole heads "
            "per rank), wo row-parallel")

    def forward(self, x):
        raise NotImplementedError(
            "implement ParallelAttention.forward: f once on x, local heads' causal attention, "
            "then wo (row-parallel)")


# The grader's entry points (the adapter). Keep these names; point them at your code.
make_column = ColumnParallelLinear
make_row = RowParallelLinear
make_mlp = ParallelMLP
make_attention = ParallelAttention


def local_params(module):
    return dict(module.named_parameters())  # the names listed in the contract
