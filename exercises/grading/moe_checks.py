"""Checks for exercise moe (MoE dispatch and combine), at 2 ranks and then at 3, where the
routing is uneven: some rank receives no token from some peer. The contract is in exercises/moe.py.

The grader decides the routing itself (each token's 2 experts and their weights), the same on
every rank, gives each rank its tokens and its experts, and compares the learner's output and
gradients with one process running every token through its experts. Every call to
dist.all_to_all_single goes through AllToAllSpy, which checks that the ranks agree on the
split sizes before the call runs: gloo aborts the process (SIGABRT, no Python exception) when a
rank receives more or fewer bytes than it expects, so the grader names the mismatch first.
"""

import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .checks import Check, Exercise, failed, passed
from .compare import TOL, differing, max_abs_diff, name_list, same, scale_of
from .spy import CollectiveSpy

DIM, HIDDEN, TOP_K, EXPERTS_PER_RANK = 8, 16, 2, 2
TOKENS_PER_RANK = {2: (6, 5), 3: (6, 5, 4)}  # uneven on purpose: fewer than DIM each
# Experts each rank's tokens may pick (None: any). At 3 ranks rank 0's tokens never go to
# rank 2's experts (4, 5) and rank 2's never to rank 1's (2, 3): zero-sized splits.
ALLOWED = {2: (None, None), 3: ((0, 1, 2, 3), None, (0, 1, 4, 5))}
SEED = 7


class Expert(torch.nn.Module):
    """One expert: gelu(x W_in^T) W_out^T, row by row."""

    def __init__(self, generator):
        super().__init__()
        self.w_in = torch.nn.Parameter(torch.randn(HIDDEN, DIM, generator=generator) / DIM**0.5)
        self.w_out = torch.nn.Parameter(torch.randn(DIM, HIDDEN, generator=generator)
                                        / HIDDEN**0.5)

    def forward(self, x):
        return F.gelu(x @ self.w_in.T) @ self.w_out.T


class Problem(NamedTuple):
    """Every rank's share of one routing, the same on every rank."""
    tokens: list  # [T_r, DIM] per rank
    expert_ids: list  # [T_r, TOP_K] int64 per rank
    weights: list  # [T_r, TOP_K] per rank, each row sums to 1
    upstream: list  # [T_r, DIM] per rank: the gradient the grader back-propagates


def make_problem(world_size):
    generator = torch.Generator().manual_seed(SEED + world_size)
    num_experts = EXPERTS_PER_RANK * world_size
    tokens, expert_ids, weights, upstream = [], [], [], []
    for rank, num_tokens in enumerate(TOKENS_PER_RANK[world_size]):
        allowed = torch.tensor(ALLOWED[world_size][rank] or range(num_experts))
        expert_ids.append(torch.stack([
            allowed[torch.randperm(len(allowed), generator=generator)[:TOP_K]]
            for _ in range(num_tokens)]))
        # The router's probabilities of the chosen k, renormalised over them.
        weights.append(torch.softmax(torch.randn(num_tokens, TOP_K, generator=generator), -1))
        tokens.append(torch.randn(num_tokens, DIM, generator=generator))
        upstream.append(torch.randn(num_tokens, DIM, generator=generator))
    used = torch.cat(expert_ids).unique().numel()
    assert used == num_experts, f"routing leaves {num_experts - used} experts idle"
    return Problem(tokens, expert_ids, weights, upstream)


def make_experts(world_size):
    generator = torch.Generator().manual_seed(SEED)
    return [Expert(generator) for _ in range(EXPERTS_PER_RANK * world_size)]


def rows_per_rank(expert_ids, world_size):
    """Rows a rank's dispatch sends to each rank: one per (token, choice)."""
    return torch.bincount((expert_ids // EXPERTS_PER_RANK).flatten(),
                          minlength=world_size).tolist()


def moe_reference(tokens, expert_ids, weights, experts):
    """One process: out[t] = sum_j weights[t, j] * expert_{expert_ids[t, j]}(tokens[t])."""
    out = torch.zeros_like(tokens)
    for e, expert in enumerate(experts):
        token, choice = (expert_ids == e).nonzero(as_tuple=True)
        out = out.index_add(0, token, expert(tokens[token]) * weights[token, choice, None])
    return out


# --- watching all_to_all_single -----------------------------------------------------------------

class SplitSizeMismatch(RuntimeError):
    """Raised on every rank, before the all-to-all, when the ranks disagree on its splits."""


class Splits(NamedTuple):
    sends: list  # rows to each rank (input_split_sizes, or the even split)
    receives: list  # rows from each rank (output_split_sizes, or the even split)
    in_backward: bool
    values: list  # the input's values when it has no split sizes (the counts), else None


def split_sizes(sizes, tensor, world_size):
    if sizes is not None and len(sizes) > 0:
        return [int(size) for size in sizes]
    if torch.is_tensor(tensor) and tensor.dim() and tensor.shape[0] % world_size == 0:
        return [tensor.shape[0] // world_size] * world_size
    return None


def split_problem(infos, number, in_backward):
    """Why the ranks' all_to_all_single number `number` cannot run, or None. infos: every
    rank's (sends, receives, input rows, output rows)."""
    where = f"all_to_all_single #{number} ({'backward' if in_backward else 'forward'})"
    for rank, (sends, receives, num_in, num_out) in enumerate(infos):
        if sends is None or sum(sends) != num_in:
            return (f"{where}: rank {rank}'s input_split_sizes {sends} do not add up to its "
                    f"input's {num_in} rows")
        if receives is None or sum(receives) != num_out:
            return (f"{where}: rank {rank}'s output_split_sizes {receives} do not add up to "
                    f"its output's {num_out} rows")
    for src, (sends, *_) in enumerate(infos):
        for dst, (_, receives, *_) in enumerate(infos):
            if sends[dst] != receives[src]:
                mirrored = all(info[0] == info[1] for info in infos)
                return (f"{where}: rank {src} sends {sends[dst]} rows to rank {dst}, which "
                        f"expects {receives[src]} (its output_split_sizes[{src}])"
                        + (": each rank used its own send counts as output_split_sizes"
                           if mirrored else "")
                        + ". output_split_sizes must be what each peer sends you: the counts "
                        "you received in the count exchange (gloo would abort on this "
                        "mismatch: the grader stopped it first)")
    return None


class AllToAllSpy(CollectiveSpy):
    """CollectiveSpy for all_to_all_single, recording each call's splits in `splits` and
    refusing, on every rank alike, a call whose splits the ranks disagree on."""

    def __init__(self, ctx):
        super().__init__(ctx.solution, names=("all_to_all_single",))
        self.ctx = ctx
        self.splits = []

    def _wrap(self, name, original):
        recorded = super()._wrap(name, original)
        signature = inspect.signature(original)
        world_size = self.ctx.world_size

        def checked(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            output, data = bound.get("output"), bound.get("input")
            sends = split_sizes(bound.get("input_split_sizes"), data, world_size)
            receives = split_sizes(bound.get("output_split_sizes"), output, world_size)
            plain = not bound.get("input_split_sizes") and torch.is_tensor(data)
            values = data.detach().flatten().tolist() if plain and data.numel() <= 64 else None
            self.splits.append(Splits(sends, receives, self.in_backward, values))
            rows = [t.shape[0] if torch.is_tensor(t) and t.dim() else None
                    for t in (data, output)]
            # The grader's own group: it never pairs with the learner's collectives.
            problem = split_problem(self.ctx.gather((sends, receives, *rows)),
                                    len(self.splits), self.in_backward)
            if problem:
                raise SplitSizeMismatch(problem)
            return recorded(*args, **kwargs)
        return checked


# --- running the learner's code ---------------------------------------------------------------

def run(ctx, spy, experts=None, backward=True):
    """The learner's moe_forward on this rank's share, then backward of sum(out * upstream).
    Returns (got, want): "output", "tokens" and "weights" (their gradients) and each local
    expert's parameters' gradients, by name; want from one process."""
    rank, world_size = ctx.rank, ctx.world_size
    problem = make_problem(world_size)
    experts = experts if experts is not None else make_experts(world_size)
    first = rank * EXPERTS_PER_RANK
    mine = list(range(first, first + EXPERTS_PER_RANK))
    local = torch.nn.ModuleList(experts[e] for e in mine)
    tokens = problem.tokens[rank].clone().requires_grad_()
    weights = problem.weights[rank].clone().requires_grad_()
    with spy:
        out = ctx.entry("moe_forward")(tokens, problem.expert_ids[rank].clone(), weights, local)
    # Backward only where every rank can run it: a rank alone in an all-to-all hangs.
    shape_ok = torch.is_tensor(out) and out.shape == tokens.shape and out.requires_grad
    if backward and all(ctx.gather(shape_ok)):
        with spy, spy.backward():
            (out * problem.upstream[rank]).sum().backward()
    got = {"output": out.detach() if torch.is_tensor(out) else None, "tokens": tokens.grad,
           "weights": weights.grad}
    for e in mine:
        for pname, param in experts[e].named_parameters():
            got[f"expert {e}.{pname}"] = param.grad

    reference = make_experts(world_size)  # fresh: the learner's experts hold its gradients
    all_tokens = torch.cat(problem.tokens).requires_grad_()
    all_weights = torch.cat(problem.weights).requires_grad_()
    ref_out = moe_reference(all_tokens, torch.cat(problem.expert_ids), all_weights, reference)
    (ref_out * torch.cat(problem.upstream)).sum().backward()
    start = sum(TOKENS_PER_RANK[world_size][:rank])
    rows = slice(start, start + tokens.shape[0])
    want = {"output": ref_out.detach()[rows], "tokens": all_tokens.grad[rows],
            "weights": all_weights.grad[rows]}
    for e in mine:
        for pname, param in reference[e].named_parameters():
            want[f"expert {e}.{pname}"] = param.grad
    return got, want


def fits(tensor, like):
    return tensor is not None and tensor.shape == like.shape


def output_problem(ctx, got):
    problem = make_problem(ctx.world_size)
    rank = ctx.rank
    want_shape = list(problem.tokens[rank].shape)
    out = got["output"]
    if out is None:
        return "moe_forward returned no tensor"
    if list(out.shape) != want_shape:
        return f"output shape {list(out.shape)}, expected {want_shape}: one row per token"
    unweighted = moe_reference(problem.tokens[rank], problem.expert_ids[rank],
                               torch.ones_like(problem.weights[rank]),
                               make_experts(ctx.world_size))
    if same(out, unweighted):
        return ("your output is the plain sum of each token's 2 expert outputs: multiply each "
                "by its router weight (weights[t, j]) before adding them up")
    return ("rows of your output differ from one process's (if 'tokens return in their "
            "original order' fails too, combine puts results at the wrong tokens)")


def grads_problem(got, want):
    for name, what in (("tokens", "dispatch must carry gradients back to the tokens: an "
                        "autograd.Function whose backward is the reverse all-to-all"),
                       ("weights", "combine must multiply by weights, differentiably")):
        if got[name] is None:
            return f"{name}.grad is None: {what}"
    missing = [name for name in want if got[name] is None]
    if missing:
        return (f"{name_list(missing)}: .grad is None: run each local expert on the rows it "
                "receives, and send its output back through combine (differentiably)")
    shapes = [name for name in want if got[name].shape != want[name].shape]
    if shapes:
        return (f"{shapes[0]}: grad shape {list(got[shapes[0]].shape)}, expected "
                f"{list(want[shapes[0]].shape)}")
    wrong = differing(got, want)
    scale = scale_of([got[n] for n in wrong], [want[n] for n in wrong])
    times = f"{scale:.2f}x one process's" if scale is not None else "not a multiple of it"
    return f"the grads of {name_list(wrong)} differ ({times})"


def make_run_check(with_grads):
    def check(ctx):
        got, want = run(ctx, AllToAllSpy(ctx))
        names = list(want) if with_grads else ["output"]
        diff = None
        if all(fits(got[name], want[name]) for name in names):
            diff, _ = max_abs_diff({n: got[n] for n in names}, {n: want[n] for n in names})
            if diff <= TOL:
                return passed(diff=diff)
        if not (fits(got["output"], want["output"]) and same(got["output"], want["output"])):
            return failed(output_problem(ctx, got), diff)
        grads = [name for name in want if name != "output"]
        return failed(grads_problem({n: got[n] for n in grads}, {n: want[n] for n in grads}),
                      diff)
    return check


def check_order(ctx):
    """Identity experts: with each row's weights summing to 1, every token must come back
    as itself, and a row that does not can be read as a mix of this rank's tokens."""
    identities = [torch.nn.Identity() for _ in range(EXPERTS_PER_RANK * ctx.world_size)]
    got, _ = run(ctx, AllToAllSpy(ctx), identities, backward=False)
    tokens = make_problem(ctx.world_size).tokens[ctx.rank]
    out = got["output"]
    if not fits(out, tokens):
        return failed(output_problem(ctx, got))
    diff = (out - tokens).abs().max().item()
    if diff <= TOL:
        return passed(diff=diff)
    scale = scale_of([out], [tokens])
    if scale is not None:
        return failed(f"every token came back {scale:.2f}x itself (the experts here return "
                      "their input and each row's weights sum to 1): weight each expert "
                      "output by weights[t, j]", diff)
    # out = mix @ tokens: this rank's tokens are independent (fewer of them than DIM).
    mix = torch.linalg.lstsq(tokens.T, out.T).solution.T
    row = next(t for t in range(out.shape[0]) if not same(out[t], tokens[t]))
    if not same(mix @ tokens, out):
        return failed(f"row {row} of your output is not made of this rank's tokens: rows "
                      "came back to the wrong rank? (combine's splits are dispatch's, swapped)",
                      diff)
    parts = [(mix[row, s].item(), s) for s in range(tokens.shape[0])
             if abs(mix[row, s].item()) > 1e-3]
    made_of = " + ".join(f"{c:.2f} x token {s}" for c, s in parts) or "zero"
    return failed(f"row {row} of your output is {made_of}, not token {row} (the experts here "
                  "return their input, each row's weights sum to 1): combine must put each "
                  "returned row back at the token it came from (undo the sort by expert)", diff)


def check_splits(ctx):
    spy = AllToAllSpy(ctx)
    run(ctx, spy)
    problem = make_problem(ctx.world_size)
    sends = rows_per_rank(problem.expert_ids[ctx.rank], ctx.world_size)
    receives = [rows_per_rank(ids, ctx.world_size)[ctx.rank] for ids in problem.expert_ids]
    forward = [s for s in spy.splits if not s.in_backward]
    backward = [s for s in spy.splits if s.in_backward]
    if len(forward) != 3:
        hint = (" (the grader sees only calls to torch.distributed.all_to_all_single: call "
                "it as dist.all_to_all_single, not through torch.distributed."
                "_functional_collectives)" if len(forward) < 3 else "")
        return failed(f"{len(forward)} all_to_all_single calls in forward, expected 3: the "
                      f"counts, then dispatch, then combine{hint}")
    counts, dispatch, combine = forward
    per_expert = torch.bincount(problem.expert_ids[ctx.rank].flatten(),
                                minlength=EXPERTS_PER_RANK * ctx.world_size).tolist()
    if counts.values not in (sends, per_expert):
        return failed(f"the count exchange (the first all_to_all_single) sent {counts.values}: "
                      f"expected the rows for each rank, {sends}, or for each expert, "
                      f"{per_expert}, with no split sizes")
    if (dispatch.sends, dispatch.receives) != (sends, receives):
        return failed(f"dispatch sends {dispatch.sends} rows to the ranks and receives "
                      f"{dispatch.receives}; expected {sends} and {receives}: one row per "
                      "(token, choice), so a token whose 2 experts live on one rank goes "
                      "there twice")
    if (combine.sends, combine.receives) != (receives, sends):
        return failed(f"combine sends {combine.sends} and receives {combine.receives}: "
                      f"expected dispatch's splits swapped, {receives} and {sends}")
    reversed_ = sorted((s.sends, s.receives) for s in backward)
    if reversed_ != sorted([(sends, receives), (receives, sends)]):
        return failed(f"{len(backward)} all_to_all_single calls in backward, expected 2 (the "
                      "reverse of combine, then of dispatch): write an autograd.Function "
                      "whose backward is the same all-to-all with the splits swapped")
    return passed(f"counts, dispatch, combine + 2 in backward; rank {ctx.rank} sends "
                  f"{', '.join(map(str, sends))} rows, receives "
                  f"{', '.join(map(str, receives))}")


EXERCISE = Exercise(
    name="moe",
    stub="moe.py",
    entry_points=("moe_forward",),
    checks=(
        Check("output = one process (top-2, 2 ranks)", make_run_check(False)),
        Check("grads = one process (tokens, weights, experts)", make_run_check(True)),
        Check("tokens return in their original order", check_order),
        Check("all_to_all_single: counts, then dispatch and combine", check_splits),
        Check("output = one process, 3 ranks (uneven, some splits 0)", make_run_check(False),
              3),
        Check("grads = one process, 3 ranks", make_run_check(True), 3),
        Check("all_to_all_single splits, 3 ranks", check_splits, 3),
    ),
)
