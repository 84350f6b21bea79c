"""Checks for exercise tp (tensor parallel by hand), at 2 ranks. The contract is in exercises/tp.py.

Every check builds the full weights, the same on every rank (one seed), gives copies to the
learner's make_* and computes the same layer in one process with the full weights. Outputs are
compared as the contract says (a column-parallel layer's with its slice of one process's);
gradients come from a fixed upstream gradient (loss = sum(out * upstream)), and a weight's
gradient is compared with this rank's slice of the full weight's gradient.
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .checks import Check, Exercise, failed, passed
from .compare import TOL, differing, max_abs_diff, name_list, same, scale_of
from .spy import CollectiveSpy

DIM, HIDDEN = 16, 24  # not square: a weight split along the wrong dim has the wrong shape
NUM_HEADS = 4  # head_dim 4; 2 heads per rank at 2 ranks
BATCH, SEQ = 2, 5
SEED = 0
# Collectives the spy watches: only all_reduce is needed; any other one is reported.
WATCHED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "broadcast")


def column_ref(x, p):
    return F.linear(x, p["weight"], p["bias"])


def mlp_ref(x, p):
    return F.linear(F.gelu(F.linear(x, p["fc1.weight"], p["fc1.bias"])),
                    p["fc2.weight"], p["fc2.bias"])


def attention_ref(x, p):
    """Causal softmax attention, heads in contiguous blocks of head_dim along wq/wk/wv's
    output dim and wo's input dim; no biases."""
    batch, seq, _ = x.shape
    head_dim = DIM // NUM_HEADS

    def heads(w):  # [batch, heads, seq, head_dim]
        return F.linear(x, w).view(batch, seq, -1, head_dim).transpose(1, 2)

    y = F.scaled_dot_product_attention(heads(p["wq.weight"]), heads(p["wk.weight"]),
                                       heads(p["wv.weight"]), is_causal=True)
    return F.linear(y.transpose(1, 2).reshape(batch, seq, -1), p["wo.weight"])


@dataclass(frozen=True)
class Kind:
    label: str
    maker: str  # the adapter's name
    shapes: dict  # name -> full shape, in the order make_* takes them
    split: dict  # name -> the dim this rank keeps a slice of, None: kept whole
    reference: Callable  # (x, {name: full tensor}) -> full output
    extra: tuple = ()  # make_* arguments after the tensors
    in_features: int = DIM
    out_features: int = DIM
    input_sliced: bool = False  # row-parallel: x is this rank's slice of the last dim
    output_sliced: bool = False  # column-parallel: the output is this rank's slice
    bias: str = None  # a row-parallel bias (kept whole, added once after the all-reduce)
    counts: tuple = (1, 1)  # all-reduces (forward, backward)


KINDS = {
    "column": Kind("column-parallel", "make_column",
                   {"weight": (HIDDEN, DIM), "bias": (HIDDEN,)}, {"weight": 0, "bias": 0},
                   column_ref, out_features=HIDDEN, output_sliced=True, counts=(0, 1)),
    "row": Kind("row-parallel", "make_row", {"weight": (DIM, HIDDEN), "bias": (DIM,)},
                {"weight": 1, "bias": None}, column_ref, in_features=HIDDEN,
                input_sliced=True, bias="bias", counts=(1, 0)),
    "mlp": Kind("MLP", "make_mlp",
                {"fc1.weight": (HIDDEN, DIM), "fc1.bias": (HIDDEN,),
                 "fc2.weight": (DIM, HIDDEN), "fc2.bias": (DIM,)},
                {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None},
                mlp_ref, bias="fc2.bias"),
    "attention": Kind("attention", "make_attention",
                      {f"{w}.weight": (DIM, DIM) for w in ("wq", "wk", "wv", "wo")},
                      {"wq.weight": 0, "wk.weight": 0, "wv.weight": 0, "wo.weight": 1},
                      attention_ref, extra=(NUM_HEADS,)),
}


def part(tensor, dim, rank, world_size):
    """This rank's slice along `dim` (the contract: world_size equal, contiguous slices)."""
    size = tensor.shape[dim] // world_size
    return tensor.narrow(dim, rank * size, size)


def randn(shape, seed, scale=1.0):
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def full_params(kind):
    return {name: randn(shape, SEED + i, 1 / math.sqrt(shape[-1]))
            for i, (name, shape) in enumerate(kind.shapes.items())}


def build(ctx, kind):
    """(full tensors, the learner's module built from copies of them)."""
    full = full_params(kind)
    module = ctx.entry(kind.maker)(*[t.clone() for t in full.values()], *kind.extra)
    return full, module


def local_params(ctx, module):
    params = ctx.entry("local_params")(module)
    return dict(params) if params is not None else {}


def describe_slice(dim, rank, world_size, full):
    size = full.shape[dim] // world_size
    what = "rows" if dim == 0 else "columns"
    return f"{what} {rank * size}-{(rank + 1) * size - 1} of the full {list(full.shape)}"


def slice_problem(kind, name, got, full, rank, world_size):
    """None when `got` is this rank's slice of `full` by the contract's rule, else why not."""
    dim = kind.split[name]
    want = full if dim is None else part(full, dim, rank, world_size)
    where = f"{kind.label} {name}"
    if got is None:
        return f"{where}: not in local_params(module) (it returned {name_list(kind.shapes)}?)"
    got = got.detach()
    if got.shape == want.shape and same(got, want):
        return None
    rule = ("column-parallel splits the output dim (rows of weight [out, in])" if dim == 0
            else "row-parallel splits the input dim (columns of weight [out, in])")
    if dim is None:
        if got.shape != full.shape:
            return (f"{where}: shape {list(got.shape)}, expected the whole {list(full.shape)}: "
                    "the row-parallel bias is kept whole and added once, after the all-reduce")
        return f"{where}: not the full bias you were given"
    if got.shape == full.shape and same(got, full):
        return (f"{where}: kept the whole {list(full.shape)}: keep only this rank's slice, "
                f"{describe_slice(dim, rank, world_size, full)} ({rule})")
    if full.dim() == 2:
        other = part(full, 1 - dim, rank, world_size)
        if got.shape == other.shape and same(got, other):
            return (f"{where}: you kept {describe_slice(1 - dim, rank, world_size, full)}: "
                    f"split the wrong dim? {rule}")
    for peer in range(world_size):
        if peer != rank and got.shape == want.shape and same(got, part(full, dim, peer,
                                                                       world_size)):
            return f"{where}: rank {rank} kept rank {peer}'s slice"
    if got.shape != want.shape:
        return (f"{where}: shape {list(got.shape)}, expected {list(want.shape)}, "
                f"{describe_slice(dim, rank, world_size, full)} ({rule})")
    return f"{where}: values differ from {describe_slice(dim, rank, world_size, full)}"


def check_slices(ctx):
    worst = 0.0
    for kind in KINDS.values():
        full, module = build(ctx, kind)
        mine = local_params(ctx, module)
        for name in kind.shapes:
            problem = slice_problem(kind, name, mine.get(name), full[name], ctx.rank,
                                    ctx.world_size)
            if problem:
                return failed(problem)
            dim = kind.split[name]
            want = full[name] if dim is None else part(full[name], dim, ctx.rank,
                                                       ctx.world_size)
            worst = max(worst, (mine[name].detach() - want).abs().max().item())
    return passed(diff=worst)


def run(ctx, kind, spy):
    """Forward and backward of the learner's module on this rank, and of one process.
    Returns (got, want, the full tensors); got and want map "output", "x" (x's gradient) and
    each parameter's name (its gradient) to tensors."""
    rank, world_size = ctx.rank, ctx.world_size
    full, module = build(ctx, kind)
    x_full = randn((BATCH, SEQ, kind.in_features), 100)
    upstream = randn((BATCH, SEQ, kind.out_features), 101)
    x = (part(x_full, -1, rank, world_size) if kind.input_sliced else x_full).clone()
    x.requires_grad_()
    my_upstream = part(upstream, -1, rank, world_size) if kind.output_sliced else upstream

    reference = {name: t.clone().requires_grad_() for name, t in full.items()}
    x_ref = x_full.clone().requires_grad_()
    out_ref = kind.reference(x_ref, reference)
    (out_ref * upstream).sum().backward()
    want = {"output": part(out_ref, -1, rank, world_size) if kind.output_sliced else out_ref,
            "x": part(x_ref.grad, -1, rank, world_size) if kind.input_sliced
            else x_ref.grad}
    for name, dim in kind.split.items():
        grad = reference[name].grad
        want[name] = grad if dim is None else part(grad, dim, rank, world_size)

    with spy:
        out = module(x)
    shape_ok = torch.is_tensor(out) and out.shape == want["output"].shape
    # Backward only where every rank can run it: a rank alone in backward's all-reduce hangs.
    if all(ctx.gather(shape_ok)):
        with spy, spy.backward():
            (out * my_upstream).sum().backward()
    mine = local_params(ctx, module)
    got = {"output": out.detach() if torch.is_tensor(out) else None, "x": x.grad}
    for name in kind.shapes:
        param = mine.get(name)
        got[name] = param.grad if param is not None else None
    return got, want, full


def output_problem(kind, got, want, outputs, full, world_size):
    """Why the output differs, in terms of the usual mistakes."""
    out, ref = got["output"], want["output"]
    if out is None:
        return f"{kind.label}: your forward returned no tensor"
    if out.shape != ref.shape:
        hint = ""
        if kind.output_sliced and out.shape[-1] == kind.out_features:
            hint = ": a column-parallel layer returns this rank's slice of the output, no gather"
        return f"{kind.label} output: shape {list(out.shape)}, expected {list(ref.shape)}{hint}"
    bias = full[kind.bias] if kind.bias else torch.zeros(())
    if kind.output_sliced:
        return f"{kind.label} output: not this rank's slice of one process's output"
    if same(out, (ref - bias) / world_size + bias):
        return (f"{kind.label} output is one process's partial sums averaged "
                f"(1/{world_size}x): averaged the partial sums? g must sum them (ReduceOp.SUM)")
    if same(out, ref + (world_size - 1) * bias):
        return (f"{kind.label} output has the bias {world_size} times: it was added on every "
                "rank before the all-reduce; add it once, after")
    if all(o is not None and o.shape == ref.shape for o in outputs):
        summed = sum(outputs)
        if any(same(summed, ref + k * bias) for k in range(world_size)):
            return (f"{kind.label} output is this rank's partial sum (the sum over ranks is one "
                    "process's): g's forward must all-reduce the partial sums")
    return f"{kind.label} output differs from one process's"


def grads_problem(kind, got, want, input_grads, world_size):
    missing = [name for name in want if got[name] is None]
    if missing:
        return (f"{kind.label}: {name_list(missing)} has no .grad after backward (is your "
                "slice an nn.Parameter, used in forward?)")
    shapes = [name for name in want if got[name].shape != want[name].shape]
    if shapes:
        name = shapes[0]
        return (f"{kind.label} {name}: grad shape {list(got[name].shape)}, expected "
                f"{list(want[name].shape)}")
    wrong = differing(got, want)
    if "x" in wrong and not kind.input_sliced and all(fits(g, want["x"]) for g in input_grads):
        if same(sum(input_grads), want["x"]):
            return (f"{kind.label}: x.grad holds only this rank's part of dL/dx (the sum over "
                    "ranks is one process's): f's backward must all-reduce the input gradient")
    scale = scale_of([got[n] for n in wrong], [want[n] for n in wrong])
    times = f"{scale:.2f}x one process's" if scale is not None else "not a multiple of it"
    if scale is not None and math.isclose(scale, world_size, rel_tol=1e-3):
        return (f"{kind.label}: the grads of {name_list(wrong)} are {times}: all-reduced in "
                "backward too? g's backward is the identity: every rank already has the whole "
                "output gradient")
    return f"{kind.label}: the grads of {name_list(wrong)} differ ({times})"


def fits(tensor, like):
    return tensor is not None and tensor.shape == like.shape


def make_run_check(kind_name, with_grads):
    kind = KINDS[kind_name]

    def check(ctx):
        got, want, full = run(ctx, kind, CollectiveSpy(ctx.solution, WATCHED))
        # Gathered on every rank whatever happens next: a gather is a collective too.
        outputs, input_grads = ctx.gather(got["output"]), ctx.gather(got["x"])
        names = list(want) if with_grads else ["output"]
        diff = None
        if all(fits(got[name], want[name]) for name in names):
            diff, _ = max_abs_diff({n: got[n] for n in names}, {n: want[n] for n in names})
            if diff <= TOL:
                return passed(diff=diff)
        if not (fits(got["output"], want["output"]) and same(got["output"], want["output"])):
            return failed(output_problem(kind, got, want, outputs, full, ctx.world_size), diff)
        grads = [name for name in want if name != "output"]
        return failed(grads_problem(kind, {n: got[n] for n in grads},
                                    {n: want[n] for n in grads}, input_grads,
                                    ctx.world_size), diff)
    return check


def check_counts(ctx):
    seen = []
    for kind in KINDS.values():
        spy = CollectiveSpy(ctx.solution, WATCHED)
        run(ctx, kind, spy)
        others = sorted({call.name for call in spy.calls if call.name != "all_reduce"})
        if others:
            return failed(f"{kind.label}: called {', '.join(others)}: these layers need only "
                          "all-reduce (g forward, f backward)")
        forward = sum(not call.in_backward for call in spy.calls)
        backward = sum(call.in_backward for call in spy.calls)
        want_fwd, want_bwd = kind.counts
        if (forward, backward) != kind.counts:
            return failed(f"{kind.label}: {forward} all-reduce(s) in forward and {backward} in "
                          f"backward, expected {want_fwd} and {want_bwd}"
                          f"{count_hint(kind, forward, backward)}")
        seen.append(f"{kind.label} {forward}+{backward}")
    return passed(", ".join(seen) + " (forward+backward)")


def count_hint(kind, forward, backward):
    want_fwd, want_bwd = kind.counts
    if forward == 0 and want_fwd and backward == 0:
        return (" (the grader counts calls to torch.distributed.all_reduce: call it as "
                "dist.all_reduce)")
    if backward < want_bwd:
        return ": f's backward (the all-reduce of the input's gradient) is missing"
    if kind.label == "attention" and backward == 3:
        return (": q, k and v each applied f? apply f once to x and give the copy to all "
                "three projections")
    if backward > want_bwd:
        return ": g's backward is the identity, no all-reduce; only f all-reduces in backward"
    if forward > want_fwd:
        return ": f's forward is the identity, no all-reduce; only g all-reduces in forward"
    return ""


EXERCISE = Exercise(
    name="tp",
    stub="tp.py",
    entry_points=("make_column", "make_row", "make_mlp", "make_attention", "local_params"),
    checks=(
        Check("weight slices: column splits the output dim, row the input", check_slices),
        Check("column-parallel output = its slice of one process's",
              make_run_check("column", with_grads=False)),
        Check("row-parallel output = one process's output", make_run_check("row", False)),
        Check("column-parallel grads = one process (x.grad via f)",
              make_run_check("column", True)),
        Check("row-parallel grads = one process", make_run_check("row", True)),
        Check("MLP (column, then row) output and grads = one process",
              make_run_check("mlp", True)),
        Check("attention (heads split) output and grads = one process",
              make_run_check("attention", True)),
        Check("all-reduces per forward and backward", check_counts),
    ),
)
