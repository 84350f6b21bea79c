"""Checks for exercise fsdp (FSDP by hand), at 2 ranks and then at 3, where no parameter of the
model divides evenly. The contract is in exercises/fsdp.py.

Every rank builds the same small model (a stem, two residual blocks, a head), wraps each of the
four blocks with the learner's make_fsdp, runs the units on its slice of the global batch, and
steps the grader's own SGD over the learner's shards (local_shards). The reference is one
process training the unwrapped model on the whole batch. What a rank holds is read directly:
the shards; the blocks' own Parameters, whose storage bytes say whether they are gathered or
freed (looked at from inside each block's forward and backward, and after them); and the
output tensors of the learner's all-gathers, which the grader's spy keeps weak references to.
"""

import copy
import gc
import inspect
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checks import Check, Exercise, failed, passed
from .compare import TOL, format_bytes, name_list
from .ddp_checks import MomentumSGD
from .spy import CollectiveSpy

IN, DIM, HIDDEN, CLASSES = 7, 10, 20, 6
# Every parameter's numel is even and none divides by 3 (70, 10, 200, 20, 60, 6): at 2 ranks
# the shards split evenly, at 3 every one of them ends in padding.
BATCH = 12  # the global batch; rank r takes rows [r * BATCH / world_size, ...)
NUM_STEPS = 3
LR, MOMENTUM = 0.1, 0.9
GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter")
# all_reduce too, to say so when a solution uses it instead of a reduce-scatter. Older torch
# has no *_single names: only the names this torch has are watched.
COLLECTIVES = tuple(name for name in (*GATHERS, *REDUCE_SCATTERS, "all_reduce")
                    if hasattr(dist, name))
# bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-9 (0.2%) of itself.
# Each rank's bf16 matmuls sum its half (or third) of the batch and round, and the ranks' parts
# are added in fp32, where one process rounds the whole-batch sum: the gradients differ by a
# few roundings, measured here at up to 0.75% of the largest gradient at 2 and 3 ranks (params
# after 3 steps: 0.04% of the largest). 5% leaves a margin of 6x; the mistakes the grader names
# are far above it (summed, not averaged: 100%), and the ones below it (a bf16 master, fp32
# compute) are caught by dtype instead.
BF16_REL_TOL = 5e-2


class Probed(torch.nn.Module):
    """A block the grader can look into while the learner's unit runs it: probe(block, phase)
    is called inside forward ("forward") and in the middle of this block's backward
    ("backward": a hook on an inner activation, whose gradient comes after the block's last
    op ran backward and before its first one does)."""

    probe = None

    def look(self, inner):
        if self.probe is not None:
            self.probe(self, "forward")
            if inner.requires_grad:
                inner.register_hook(lambda grad: self.probe(self, "backward"))
        return inner


class Stem(Probed):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(IN, DIM)

    def forward(self, x):
        return torch.tanh(self.look(self.fc(x)))


class Block(Probed):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.look(self.fc1(self.norm(x)))))


class Head(Probed):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.fc = torch.nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.fc(self.look(self.norm(x)))


def build_model():
    """The same values on every rank and in the reference. LayerNorm starts at weight 1, bias
    0: nudged, so that a shard in the wrong place cannot look right by chance."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Stem(), Block(), Block(), Head())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def global_batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, IN, generator=generator),
            torch.randint(CLASSES, (BATCH,), generator=generator))


def rows_of(rank, world_size):
    return slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)


def loss_fn(out, targets):
    # A mean over this rank's rows: the mean over ranks of equal slices is the global mean.
    return F.cross_entropy(out.float(), targets)


def shard_size(numel, world_size):
    return math.ceil(numel / world_size)


def expected_shard(tensor, rank, world_size):
    """The contract's rule: flatten, zero-pad to world_size * k, keep [rank * k, (rank+1) * k)."""
    k = shard_size(tensor.numel(), world_size)
    flat = torch.zeros(world_size * k)
    flat[:tensor.numel()] = tensor.detach().float().reshape(-1)
    return flat[rank * k:(rank + 1) * k]


def sliced(tensors, rank, world_size):
    return {key: expected_shard(tensor, rank, world_size) for key, tensor in tensors.items()}


def label(key):
    return f"{key[0]}.{key[1]}"  # (block index, name) -> "2.fc1.weight"


class GatherSpy(CollectiveSpy):
    """CollectiveSpy over the FSDP collectives that also keeps a weak reference to each
    all-gather's output tensors: alive with bytes after a unit is done = still held."""

    def __init__(self, solution):
        super().__init__(solution, names=COLLECTIVES)
        self.outputs = []

    def _wrap(self, name, original):
        recorded = super()._wrap(name, original)
        if name not in GATHERS:
            return recorded
        signature = inspect.signature(original)

        def watched(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            out = bound.get("output_tensor", bound.get("tensor_list"))
            for tensor in out if isinstance(out, (list, tuple)) else [out]:
                if torch.is_tensor(tensor):
                    self.outputs.append(weakref.ref(tensor))
            return recorded(*args, **kwargs)
        return watched

    def held_bytes(self):
        gc.collect()  # a buffer kept only by a reference cycle is freed here, not "held"
        alive = [ref() for ref in self.outputs]
        return sum(t.untyped_storage().nbytes() for t in alive if t is not None)


class Run:
    """One rank's model, wrapped block by block by the learner, and its training loop."""

    def __init__(self, ctx, compute_dtype=None, momentum=MOMENTUM):
        self.ctx = ctx
        self.blocks = list(build_model())
        # The blocks' own Parameters, taken before make_fsdp: the contract keeps them in place.
        self.params = [dict(block.named_parameters()) for block in self.blocks]
        self.initial = {(i, n): p.detach().clone()
                        for i, params in enumerate(self.params) for n, p in params.items()}
        self.units = [ctx.entry("make_fsdp")(block, compute_dtype=compute_dtype)
                      for block in self.blocks]
        self.shards = [ctx.entry("local_shards")(unit) for unit in self.units]
        self.momentum = momentum
        self.optimizer = None  # built at the first step, once the shards are known to be good

    def problem(self):
        """Why the grader cannot use what make_fsdp and local_shards gave on some rank, or
        None. A collective: every rank gets the same answer, so either all of them stop here
        or none does (a rank that stopped alone would leave its peers in a collective)."""
        mine = self.local_problem()
        every = self.ctx.gather(mine)
        return mine or next((f"rank {r}: {p}" for r, p in enumerate(every) if p), None)

    def local_problem(self):
        for i, (block, params, shards) in enumerate(zip(self.blocks, self.params, self.shards)):
            if not isinstance(shards, dict) or sorted(shards) != sorted(params):
                got = sorted(shards) if isinstance(shards, dict) else type(shards).__name__
                return (f"local_shards(unit) of block {i} gives {got}, expected a dict with "
                        f"the block's parameter names {sorted(params)}")
            wrong = [n for n, s in shards.items() if not torch.is_tensor(s)
                     or s.dtype != torch.float32 or not s.requires_grad]
            if wrong:
                shard = shards[wrong[0]]
                what = (f"{shard.dtype}, requires_grad={shard.requires_grad}"
                        if torch.is_tensor(shard) else type(shard).__name__)
                return (f"block {i}: the shards of {name_list(wrong)} are not fp32 tensors "
                        f"that require grad ({what}): the master shards stay fp32, whatever "
                        "the compute dtype")
            now = dict(block.named_parameters())
            replaced = [n for n, p in params.items() if now.get(n) is not p]
            if replaced:
                return (f"block {i}: make_fsdp replaced {name_list(replaced)}: keep the block's "
                        "own Parameter objects (free their storage instead)")
        for (i, name), param in self.initial.items():
            shard, k = self.shards[i][name], shard_size(param.numel(), self.ctx.world_size)
            if shard.dim() != 1 or shard.numel() != k:
                return explain_shard_size(f"{i}.{name}", shard, param.numel(), self.ctx.world_size)
        return None

    def all_shards(self):
        return [shard for shards in self.shards for shard in shards.values()]

    def step(self, step, spy=None, after_forward=None):
        """Forward and backward on this rank's slice, then the grader's SGD step on the
        shards; {(block, name): the shard's .grad} as backward left it."""
        for shard in self.all_shards():
            shard.grad = None
        x, targets = (t[rows_of(self.ctx.rank, self.ctx.world_size)] for t in global_batch(step))
        spy = spy or GatherSpy(self.ctx.solution)
        with spy:
            for unit in self.units:
                x = unit(x)
            if after_forward:
                after_forward()
            loss = loss_fn(x, targets)
            with spy.backward():
                loss.backward()
        grads = {(i, n): s.grad for i, shards in enumerate(self.shards) for n, s in shards.items()}
        grads = {key: None if g is None else g.detach().clone() for key, g in grads.items()}
        self.optimizer = self.optimizer or MomentumSGD(self.all_shards(), LR, self.momentum)
        self.optimizer.step()
        return grads

    def gather_full(self):
        """The full parameters, assembled by the grader from every rank's shards by the
        contract's rule (through the grader's own group, not the learner's code)."""
        every = self.ctx.gather([{n: s.detach().float().clone() for n, s in shards.items()}
                                 for shards in self.shards])
        return {(i, n): torch.cat([every[r][i][n] for r in range(self.ctx.world_size)])
                [:p.numel()].view(p.shape)
                for i, params in enumerate(self.params) for n, p in params.items()}


def reference_grads(model, step, rows=slice(None), compute_dtype=None):
    """{(block, name): grad} of one process on the global batch (or on `rows` of it)."""
    x, targets = (t[rows] for t in global_batch(step))
    if compute_dtype is not None:  # the same casting as the contract: params and inputs
        model, x = copy.deepcopy(model).to(compute_dtype), x.to(compute_dtype)
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), targets).backward()
    return {(i, n): p.grad.float() for i, block in enumerate(model)
            for n, p in block.named_parameters()}


def train_reference(num_steps, compute_dtype=None):
    """One process, whole batch, fp32 master params: ([grads of each step], final params)."""
    model = build_model()
    optimizer = MomentumSGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    grads = []
    for step in range(num_steps):
        grads.append(reference_grads(model, step, compute_dtype=compute_dtype))
        for (i, n), grad in grads[-1].items():
            model[i].get_parameter(n).grad = grad
        optimizer.step()
    return grads, {(i, n): p.detach() for i, block in enumerate(model)
                   for n, p in block.named_parameters()}


def check_shards(ctx):
    run = Run(ctx)
    problem = run.problem()  # names, dtypes, and each shard's size: k elements, 1-D
    if problem:
        return failed(problem)
    worst, why = 0.0, None
    for (i, name), param in run.initial.items():
        shard = run.shards[i][name].detach()
        diff = (shard - expected_shard(param, ctx.rank, ctx.world_size)).abs().max().item()
        if diff > TOL and why is None:
            why = explain_shard_values(f"{i}.{name}", shard, param, ctx.rank, ctx.world_size)
        worst = max(worst, diff)
    per_rank = ctx.gather(sum(s.numel() * s.element_size() for s in run.all_shards()))
    if why:
        return failed(why, worst)
    full = sum(p.numel() * p.element_size() for p in run.initial.values())
    return passed(f"per rank {', '.join(format_bytes(b) for b in per_rank)} of "
                  f"{format_bytes(full)} (padding included)", worst)


def explain_shard_size(name, shard, numel, world_size):
    k = shard_size(numel, world_size)
    rule = (f"{numel} elements over {world_size} ranks: k = ceil({numel} / {world_size}) = {k}, "
            f"the flat param zero-padded to {world_size * k}")
    if shard.dim() != 1 or shard.numel() > k:
        return f"the shard of {name} has shape {tuple(shard.shape)}, expected ({k},) ({rule})"
    cause = ("numel // world_size drops the remainder;" if shard.numel() == numel // world_size
             else "a short last shard?")
    return (f"the shard of {name} has {shard.numel()} elements, expected {k} ({rule}): {cause} "
            "pad the flat param to a multiple of world_size")


def explain_shard_values(name, shard, param, rank, world_size):
    k = shard_size(param.numel(), world_size)
    for other in range(world_size):
        if other != rank and (shard - expected_shard(param, other, world_size)).abs().max() <= TOL:
            return (f"the shard of {name} holds rank {other}'s elements: rank {rank} keeps "
                    f"[{rank * k}, {(rank + 1) * k}) of the flat param")
    return (f"the shard of {name} is not elements [{rank * k}, {(rank + 1) * k}) of the "
            f"flattened param zero-padded to {world_size * k}")


def fitted_scale(got, want, rel_residual):
    """c when got ~ c * want (least squares, relative residual under rel_residual), else None."""
    got, want = torch.cat([g.flatten() for g in got]), torch.cat([w.flatten() for w in want])
    scale = (got @ want / (want @ want)).item()
    ok = (got - scale * want).norm() <= rel_residual * max(got.norm().item(), 1e-12)
    return scale if ok else None


def explain_grads(got, want, local, world_size, rel_tol=None):
    """(max |diff|, None) when the grad shards match `want`, else (max |diff|, why). rel_tol:
    relative to the largest gradient (bf16); None: fp32's TOL."""
    missing = [label(key) for key in want if got.get(key) is None]
    if missing:
        return math.inf, (f".grad of the shards of {name_list(missing)} is None after "
                          "backward: reduce-scatter each unit's gradients into its shards' "
                          ".grad from the gradient hooks")
    diff = max((got[key] - want[key]).abs().max().item() for key in want)
    limit = TOL if rel_tol is None else rel_tol * max(w.abs().max().item() for w in want.values())
    if diff <= limit:
        return diff, None
    wrong = [key for key in want if (got[key] - want[key]).abs().max() > limit]
    names = name_list(label(key) for key in wrong)
    if local is not None and all((got[key] - local[key]).abs().max() <= limit for key in wrong):
        return diff, (f"the grad shards of {names} hold this rank's own gradient: "
                      "reduce-scatter them across ranks, then divide by world_size")
    scale = fitted_scale([got[k] for k in wrong], [want[k] for k in wrong], rel_tol or 1e-3)
    times = f"{scale:.2f}x the reference" if scale is not None else "not a multiple of it"
    if len(wrong) == len(want) and scale is not None:
        if math.isclose(scale, world_size, rel_tol=1e-2):
            return diff, (f"summed but not averaged? your grad shards are {times}: divide the "
                          "reduce-scatter's sum by world_size")
        if math.isclose(scale, 1 / world_size, rel_tol=1e-2):
            return diff, f"averaged twice? your grad shards are {times}: divide by world_size once"
    return diff, f"the grad shards of {names} differ from the reference's slices ({times})"


def check_grads(ctx):
    run = Run(ctx)
    problem = run.problem()
    if problem:
        return failed(problem)
    got = run.step(0)
    reference = build_model()
    want = sliced(reference_grads(reference, 0), ctx.rank, ctx.world_size)
    local = sliced(reference_grads(reference, 0, rows_of(ctx.rank, ctx.world_size)),
                   ctx.rank, ctx.world_size)
    diff, why = explain_grads(got, want, local, ctx.world_size)
    return passed(diff=diff) if why is None else failed(why, diff)


def check_training(ctx):
    run = Run(ctx)
    problem = run.problem()
    if problem:
        return failed(problem)
    ref_grads, ref_params = train_reference(NUM_STEPS)
    first_bad_step = None
    for step in range(NUM_STEPS):
        got = run.step(step)
        want = sliced(ref_grads[step], ctx.rank, ctx.world_size)
        if first_bad_step is None and explain_grads(got, want, None, ctx.world_size)[1]:
            first_bad_step = step
    full = run.gather_full()
    diff = max((full[key] - ref_params[key]).abs().max().item() for key in ref_params)
    if diff > TOL:
        worst = max(ref_params, key=lambda key: (full[key] - ref_params[key]).abs().max())
        if first_bad_step:
            return failed(f"grads right at step 0, wrong from step {first_bad_step}: stale "
                          "params (gather the shards the optimizer updated before every "
                          "forward)? or full grads left over from the step before (set them to "
                          "None after the reduce-scatter)?", diff)
        return failed(f"{label(worst)} is off after {NUM_STEPS} steps (grads wrong from step "
                      "0: see the grad check)", diff)
    states = [ctx.entry("full_state")(unit) for unit in run.units]  # every rank, every unit
    for i, (state, params) in enumerate(zip(states, run.params)):
        if not isinstance(state, dict) or sorted(state) != sorted(params):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            return failed(f"full_state(unit) of block {i} gives {got}, expected {sorted(params)}")
        for name, param in params.items():
            tensor, want = state[name], full[(i, name)]
            if not (torch.is_tensor(tensor) and tensor.shape == param.shape
                    and tensor.dtype == torch.float32):
                what = (f"{tuple(tensor.shape)} {tensor.dtype}" if torch.is_tensor(tensor)
                        else type(tensor).__name__)
                return failed(f"full_state(unit)[{name!r}] of block {i} is {what}, expected "
                              f"{tuple(param.shape)} torch.float32: unpad the gathered flat "
                              "param, then view it in the param's shape")
            if (tensor - want).abs().max() > TOL:
                return failed(f"full_state(unit)[{name!r}] of block {i} differs from the param "
                              "assembled from every rank's shard: gather all ranks' shards, in "
                              "rank order", (tensor - want).abs().max().item())
    return passed(diff=diff)


def check_collectives(ctx):
    run = Run(ctx)
    problem = run.problem()
    if problem:
        return failed(problem)
    num_units, num_params = len(run.units), sum(len(params) for params in run.params)
    spies = [GatherSpy(ctx.solution) for _ in range(2)]
    for step, spy in enumerate(spies):  # both steps first: no rank leaves while others run
        run.step(step, spy)
    for step, spy in enumerate(spies):
        forward = sum(c.name in GATHERS and not c.in_backward for c in spy.calls)
        backward = sum(c.name in GATHERS and c.in_backward for c in spy.calls)
        scatters = [c for c in spy.calls if c.name in REDUCE_SCATTERS]
        reduces = sum(c.name == "all_reduce" for c in spy.calls)
        if not spy.calls:
            return failed("no collective seen: the grader counts "
                          f"dist.{', dist.'.join(COLLECTIVES)} (call them as dist.<name>)")
        if forward != num_units:
            hint = (": one per parameter? gather a unit's shards in one call"
                    if forward == num_params else "")
            return failed(f"step {step}: {forward} all-gathers in forward, expected "
                          f"{num_units}, one per unit{hint}")
        if backward != num_units:
            hint = {0: ": free the params after forward and all-gather them again before the "
                       "unit's backward (a hook on the unit's output)",
                    num_params: ": one per parameter? gather a unit's shards in one call"}
            return failed(f"step {step}: {backward} all-gathers during backward, expected "
                          f"{num_units}, one per unit{hint.get(backward, '')}")
        if reduces:
            return failed(f"step {step}: {reduces} all-reduces: each rank needs only its "
                          "shard's gradient: reduce-scatter, one per unit")
        if len(scatters) != num_units:
            hint = (": one per parameter? reduce-scatter a unit's gradients in one call"
                    if len(scatters) == num_params else "")
            return failed(f"step {step}: {len(scatters)} reduce-scatters, expected "
                          f"{num_units}, one per unit{hint}")
        if not all(c.in_backward for c in scatters):
            return failed(f"step {step}: reduce-scatters after backward: launch each unit's "
                          "from its gradient hooks, so its full gradients go as backward goes")
    return passed(f"per step: {num_units} all-gathers in forward, {num_units} in backward, "
                  f"{num_units} reduce-scatters in backward")


class Watch:
    """What the grader sees of the blocks while the learner's units run them, and after."""

    def __init__(self, run, compute_dtype=None):
        self.run, self.dtype = run, compute_dtype or torch.float32
        self.expected = dict(run.initial)  # {(block, name): full param}, renewed every step
        self.in_use = []  # what was wrong while a block computed; the first is reported
        self.held = {}  # "forward" / "backward" / ... -> most units seen still gathered then
        self.leftovers = []  # full-size grads or all-gather outputs still held
        for index, block in enumerate(run.blocks):
            block.index, block.probe = index, self.probe

    def gathered(self, index):
        return [n for n, p in self.run.params[index].items() if p.untyped_storage().nbytes()]

    def probe(self, block, phase):
        """Inside block i's forward or backward: its params whole, current, in the compute
        dtype; in forward, every earlier unit already freed."""
        i, where = block.index, f"during block {block.index}'s {phase}"
        for name, param in self.run.params[i].items():
            if param.untyped_storage().nbytes() < param.numel() * param.element_size():
                return self.note(self.in_use, f"{where}, {name} holds no data: all-gather "
                                 f"the unit's params before its {phase}")
            if param.dtype != self.dtype:
                return self.note(self.in_use, f"{where}, {name} is {param.dtype}: the "
                                 f"block computes in {self.dtype}")
            want = self.expected[(i, name)].to(self.dtype).float()
            if (param.detach().float() - want).abs().max() > TOL:
                return self.note(self.in_use, f"{where}, {name} is not the current full "
                                 "param (stale?): gather the shards the optimizer updated")
        if phase == "forward":
            self.count_held("forward", range(i))

    def count_held(self, when, indices):
        num_held = sum(bool(self.gathered(i)) for i in indices)
        if num_held:
            self.held[when] = max(num_held, self.held.get(when, 0))

    @staticmethod
    def note(problems, problem):
        if problem not in problems:
            problems.append(problem)

    def after(self, when, spy):
        self.count_held(when, range(len(self.run.blocks)))
        if when == "backward":
            left = [f"{i}.{n}" for i, params in enumerate(self.run.params)
                    for n, p in params.items() if p.grad is not None]
            if left:
                self.note(self.leftovers, f"full-size .grad left on {name_list(left)} after "
                          "backward: set it to None once it is reduce-scattered")
        buffers = spy.held_bytes()
        if buffers:
            self.note(self.leftovers, f"your all-gathers' output tensors still hold "
                      f"{format_bytes(buffers)} after {when}: release them, or resize their "
                      "storage to 0")

    def verdict(self):
        if self.in_use:
            return failed(self.in_use[0])
        if self.held:
            phases = " and ".join(f"after {when} ({n} of {len(self.run.blocks)})"
                                  for when, n in self.held.items())
            if "forward" in self.held and "backward" in self.held:
                advice = ("never freed? free a unit's params when its forward returns and again "
                          "once its gradients are reduce-scattered")
            elif "forward" in self.held:
                advice = ("free a unit's params as soon as its forward returns, and all-gather "
                          "them again before its backward")
            else:
                advice = "free each unit's params once its gradients are reduce-scattered"
            return failed(f"units still gathered {phases}: {advice} "
                          "(p.untyped_storage().resize_(0))")
        if self.leftovers:
            return failed(self.leftovers[0])
        return passed("after each forward and backward: 0 bytes in every block's params")


def check_freed(ctx):
    run = Run(ctx, momentum=0.0)
    problem = run.problem()
    if problem:
        return failed(problem)
    watch = Watch(run)
    watch.after("construction", GatherSpy(ctx.solution))
    for step in range(2):  # the second forward must gather what the optimizer updated
        spy = GatherSpy(ctx.solution)
        run.step(step, spy, after_forward=lambda: watch.after("forward", spy))
        watch.after("backward", spy)
        watch.expected = run.gather_full()
    return watch.verdict()


def check_bf16(ctx):
    dtype = torch.bfloat16
    run = Run(ctx, dtype)
    problem = run.problem()
    if problem:
        return failed(problem)
    watch = Watch(run, dtype)
    ref_grads, ref_params = train_reference(NUM_STEPS, dtype)
    steps = []
    for step in range(NUM_STEPS):  # every step first: no rank leaves while others run
        steps.append(run.step(step))
        watch.expected = run.gather_full()
    if watch.in_use:
        return failed(watch.in_use[0])
    worst = 0.0
    for step, got in enumerate(steps):
        not_fp32 = [label(k) for k, g in got.items() if g is not None and g.dtype != torch.float32]
        if not_fp32:
            return failed(f"the grad shards of {name_list(not_fp32)} are not fp32: upcast the "
                          "bf16 gradients before the reduce-scatter")
        want = sliced(ref_grads[step], ctx.rank, ctx.world_size)
        diff, why = explain_grads(got, want, None, ctx.world_size, BF16_REL_TOL)
        if why:
            return failed(f"step {step}: {why} (bf16 tolerance: {BF16_REL_TOL:.0%} of the "
                          "largest gradient)", diff)
        worst = max(worst, diff)
    diff = max((watch.expected[key] - ref_params[key]).abs().max().item() for key in ref_params)
    scale = max(p.abs().max().item() for p in ref_params.values())
    if diff > BF16_REL_TOL * scale:
        return failed(f"params off after {NUM_STEPS} steps by more than {BF16_REL_TOL:.0%} of "
                      "the largest param: update the fp32 master shards, not a bf16 copy", diff)
    return passed(f"grads within {worst:.1e}, params within {diff:.1e} "
                  f"(limit {BF16_REL_TOL:.0%} of the largest)")


EXERCISE = Exercise(
    name="fsdp",
    stub="fsdp.py",
    entry_points=("make_fsdp", "local_shards", "full_state"),
    checks=(
        Check("shards: rank r keeps [r*k, (r+1)*k) of the padded flat param", check_shards),
        Check("grad shards equal one process's gradient, sliced", check_grads),
        Check(f"shards and full_state equal one process after {NUM_STEPS} SGD steps",
              check_training),
        Check("per unit per step: 2 all-gathers (forward, backward), 1 reduce-scatter",
              check_collectives),
        Check("gathered params freed after forward and after backward", check_freed),
        Check("bf16 compute, fp32 master shards: equal one process casting alike", check_bf16),
        Check("shards at 3 ranks (no parameter divides by 3)", check_shards, 3),
        Check("grad shards equal one process's gradient, sliced, 3 ranks", check_grads, 3),
        Check(f"shards and full_state equal one process after {NUM_STEPS} SGD steps, 3 ranks",
              check_training, 3),
    ),
    hints=(
        ("out of bounds for storage of size 0",
         "backward ran on freed params: all-gather them again before the unit's backward"),
        ("data is not allocated yet",
         "backward ran on freed params: all-gather them again before the unit's backward"),
        ("modified by an inplace operation",
         "fill the gathered params through p.data: p.copy_ bumps the version counter "
         "autograd checks in backward"),
    ),
)
