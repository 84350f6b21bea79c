"""Checks for exercise ddp (DDP by hand), at 2 ranks. The contract is in exercises/ddp.py.

Every check builds a fresh model on each rank (a different seed per rank, so a missing
broadcast shows), wraps it with the learner's make_ddp, runs steps the way the contract says
and compares with one process training the whole global batch (rank 0's initial weights).
"""

import math

import torch
import torch.nn.functional as F

from .compare import (TOL, differing, format_bytes, max_abs_diff, name_list, same,
                      scale_of)
from .checks import Check, Exercise, failed, passed
from .spy import CollectiveSpy

VOCAB, DIM, HIDDEN = 32, 16, 64
BATCH, SEQ = 8, 6  # the global batch; rank r takes rows [r * BATCH / world_size, ...)
SEED = 1234  # rank r builds its model with SEED + r: the replicas start different
TIED = "embed.weight"  # the same Parameter as head.weight
FROZEN = ("frozen.weight", "frozen.bias")
# On this model (backward order: norm.bias 64 B, norm.weight 64 B, fc2.bias 64 B, fc2.weight
# 4 KiB, fc1.bias 256 B, fc1.weight 4 KiB, embed.weight 2 KiB): 5 buckets, then 2.
BUCKET_SIZES = (1024, 8192)
NUM_STEPS = 5


class TinyTiedLM(torch.nn.Module):
    """Every case the contract names: one Parameter used twice (the embedding is the output
    layer), a frozen layer, a buffer, and parameters of several sizes for the buckets."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.frozen = torch.nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.rand(DIM) + 0.5)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + torch.tanh(self.frozen(x))
        x = x + self.fc2(torch.relu(self.fc1(x))) * self.scale
        return self.head(self.norm(x))


def build_model(seed):
    torch.manual_seed(seed)
    return TinyTiedLM()


def global_batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(VOCAB, (BATCH, SEQ), generator=generator)
    return tokens, torch.randint(VOCAB, (BATCH, SEQ), generator=generator)


def local_batch(step, rank, world_size):
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    return tuple(t[rows] for t in global_batch(step))


def loss_fn(logits, targets):
    # A mean over this rank's rows: the average over ranks of equal-sized slices is the mean
    # over the global batch, so averaged gradients equal the one-process gradients.
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


class MomentumSGD:
    """torch.optim.SGD(params, lr, momentum) written out: torch.optim's first step() imports
    torch._dynamo (1 s or more per process), and the grader needs nothing else from it."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.velocity = [None] * len(self.params)

    @torch.no_grad()
    def step(self):
        for index, param in enumerate(self.params):
            if param.grad is None:
                continue
            velocity = self.velocity[index]
            if velocity is None:
                velocity = self.velocity[index] = param.grad.clone()
            else:
                velocity.mul_(self.momentum).add_(param.grad)
            param.add_(velocity, alpha=-self.lr)


def grads_of(model, tokens, targets):
    model.zero_grad(set_to_none=True)
    loss_fn(model(tokens), targets).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def expected_buckets(model, bucket_bytes):
    """The contract's bucket rule: trainable parameters in reverse order of parameters(); a
    bucket closes when the next one would take it over bucket_bytes (None or 0: one each)."""
    buckets, size = [], 0
    for param in trainable(model)[::-1]:
        nbytes = param.numel() * param.element_size()
        if not buckets or not bucket_bytes or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += nbytes
    return buckets


def wrap(ctx, bucket_bytes, spy=None):
    """This rank's model (its own seed) wrapped by the learner's make_ddp."""
    model = build_model(SEED + ctx.rank)
    if spy is not None:
        # Registered before make_ddp runs, so it fires before the learner's hook on the same
        # tensor (hooks on one tensor run in the order they were registered).
        model.embed.weight.register_post_accumulate_grad_hook(spy.mark)
    return model, ctx.entry("make_ddp")(model, bucket_bytes)


def learner_step(ctx, model, wrapper, step, spy=None):
    """One step as the contract says; {name: .grad} of the trainable parameters after it."""
    spy = spy or CollectiveSpy(ctx.solution)
    for param in model.parameters():
        param.grad = None
    tokens, targets = local_batch(step, ctx.rank, ctx.world_size)
    spy.calls.clear()
    with spy:
        loss = loss_fn(wrapper(tokens), targets)
        with spy.backward():
            loss.backward()
        ctx.entry("finish_gradient_sync")(wrapper)
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def mode_name(bucket_bytes):
    return f"buckets of {format_bytes(bucket_bytes)}" if bucket_bytes else "per-parameter"


def explain_grads(got, want, local, world_size):
    """Why the learner's grads differ from the reference, in terms of the usual mistakes."""
    wrong = differing(got, want)
    missing = [name for name in wrong if got.get(name) is None]
    if missing:
        return f"{name_list(missing)}: .grad is None after finish_gradient_sync"
    if all(same(got[name], local[name]) for name in wrong):
        return (f".grad of {name_list(wrong)} still holds this rank's own gradient after "
                "finish_gradient_sync: did it wait for the all-reduce and copy the result back?")
    scale = scale_of([got[n] for n in wrong], [want[n] for n in wrong])
    times = f"{scale:.2f}x the reference" if scale is not None else "not a multiple of it"
    if wrong == [TIED]:
        return (f"only {TIED} is wrong ({times}): the tied weight (embed = head) counted "
                "twice? a Parameter used twice has one gradient: reduce and average it once")
    if len(wrong) == len(want) and scale is not None:
        if math.isclose(scale, 1 / world_size, rel_tol=1e-3):
            return f"averaged twice? your grads are {times}: divide by world_size once"
        if math.isclose(scale, world_size, rel_tol=1e-3):
            return f"summed but not averaged? your grads are {times}: divide by world_size"
    return f"wrong for {name_list(wrong)} ({times})"


def check_broadcast(ctx):
    model, _ = wrap(ctx, None)
    reference = build_model(SEED)  # what rank 0 built

    def tensors(m):
        return {**dict(m.named_parameters()),
                **{f"buffer {name}": b for name, b in m.named_buffers()}}

    diff, worst = max_abs_diff(tensors(model), tensors(reference))
    if diff <= TOL:
        return passed(diff=diff)
    if not differing(dict(model.named_parameters()), dict(reference.named_parameters())):
        return failed(f"{worst} differs from rank 0's: broadcast the buffers too", diff)
    return failed(f"{worst} differs from rank 0's: broadcast rank 0's parameters and "
                  "buffers in the constructor", diff)


def make_grads_check(bucket_bytes):
    def check_grads(ctx):
        model, wrapper = wrap(ctx, bucket_bytes)
        start = dict(build_model(SEED).named_parameters())
        all_started_equal = all(ctx.gather(not differing(dict(model.named_parameters()), start)))
        got = learner_step(ctx, model, wrapper, step=0)
        want = grads_of(build_model(SEED), *global_batch(0))
        diff, _ = max_abs_diff(got, want)
        if diff <= TOL:
            return passed(diff=diff)
        if not all_started_equal:
            return failed("the replicas did not start equal (see the first check), so their "
                          "gradients cannot match", diff)
        local = grads_of(build_model(SEED), *local_batch(0, ctx.rank, ctx.world_size))
        return failed(explain_grads(got, want, local, ctx.world_size), diff)
    return check_grads


def check_tied(ctx):
    want = grads_of(build_model(SEED), *global_batch(0))
    local = grads_of(build_model(SEED), *local_batch(0, ctx.rank, ctx.world_size))
    worst = 0.0
    for bucket_bytes in (None, BUCKET_SIZES[0]):
        model, wrapper = wrap(ctx, bucket_bytes)
        got = learner_step(ctx, model, wrapper, step=0)
        diff, _ = max_abs_diff({TIED: got[TIED]}, {TIED: want[TIED]})
        worst = max(worst, diff)
        if diff <= TOL:
            continue
        wrong = differing(got, want)
        if wrong != [TIED]:  # not a tied-weight problem: say what the grads checks say
            return failed(f"{mode_name(bucket_bytes)}: not only the tied weight is wrong: "
                          f"{explain_grads(got, want, local, ctx.world_size)}", diff)
        scale = scale_of([got[TIED]], [want[TIED]]) if got[TIED] is not None else None
        times = f"{scale:.2f}x the reference" if scale is not None else "wrong"
        return failed(f"{mode_name(bucket_bytes)}: only {TIED} (the same Parameter as "
                      f"head.weight) is wrong, {times}: counted twice? a Parameter used twice "
                      "has one gradient: reduce and average it once", diff)
    return passed(diff=worst)


def check_frozen(ctx):
    model, wrapper = wrap(ctx, BUCKET_SIZES[0])
    # As they were after construction: equal to rank 0's is check_broadcast's business.
    frozen = {name: model.get_parameter(name).detach().clone() for name in FROZEN}
    optimizer = MomentumSGD(trainable(model), lr=0.1, momentum=0.0)
    for step in range(2):
        learner_step(ctx, model, wrapper, step)
        with_grad = [n for n in FROZEN if model.get_parameter(n).grad is not None]
        if with_grad:
            return failed(f"{name_list(with_grad)} has a .grad after finish_gradient_sync: "
                          "skip parameters with requires_grad=False")
        optimizer.step()
    diff, worst = max_abs_diff(dict(model.named_parameters()), frozen)
    if diff > TOL:
        return failed(f"{worst} changed: leave parameters with requires_grad=False alone", diff)
    return passed(diff=diff)


def check_bucket_count(ctx):
    seen = []
    for bucket_bytes in (None, *BUCKET_SIZES):
        spy = CollectiveSpy(ctx.solution)
        model, wrapper = wrap(ctx, bucket_bytes)
        learner_step(ctx, model, wrapper, 0, spy)
        want, got = len(expected_buckets(model, bucket_bytes)), len(spy.calls)
        if got == want:
            seen.append(f"{mode_name(bucket_bytes)}: {got}")
            continue
        hint = ""
        if got == 0:
            hint = " (the grader counts calls to torch.distributed.all_reduce)"
        elif got == want + 1 and not bucket_bytes:
            hint = ": one extra, the tied weight counted twice?"
        elif got == len(trainable(model)):
            hint = ": one per parameter, bucket_bytes ignored?"
        return failed(f"{mode_name(bucket_bytes)}: {got} all-reduces in one step, expected "
                      f"{want} (trainable params in reverse order of parameters(), a bucket "
                      f"closing when the next param would take it over the cap){hint}")
    return passed("; ".join(seen))


def check_overlap(ctx):
    """Overlap, told by counting (spy.py): an all-reduce seen during loss.backward() came
    from a hook. That alone would also pass a solution that launches every bucket from the
    very last hook (no overlap at all), so the grader also counts the calls made before
    backward's last gradient: the embedding weight's (the embedding is the model's first op),
    marked by the grader's own hook on it."""
    spy = CollectiveSpy(ctx.solution)
    model, wrapper = wrap(ctx, BUCKET_SIZES[0], spy)
    learner_step(ctx, model, wrapper, 0, spy)
    during = [call.async_op for call in spy.calls if call.in_backward]
    if not during:
        return failed(f"none of {len(spy.calls)} all-reduces was launched during backward: "
                      "launch each bucket from the gradient hook of its last parameter")
    if not spy.calls_at_mark:
        return failed("every all-reduce was launched after backward's last gradient was "
                      "ready: nothing overlaps; launch each bucket as soon as it is full")
    if not all(during):
        return failed("all_reduce with async_op=False inside backward blocks it until the "
                      "bucket is reduced: use async_op=True, wait in finish_gradient_sync")
    return passed(f"{spy.calls_at_mark} of {len(spy.calls)} launched before backward's "
                  "last gradient")


def check_training(ctx):
    model, wrapper = wrap(ctx, BUCKET_SIZES[1])
    reference = build_model(SEED)
    optimizers = [MomentumSGD(trainable(m), lr=0.05, momentum=0.9) for m in (model, reference)]
    first_bad_step = None
    for step in range(NUM_STEPS):
        got = learner_step(ctx, model, wrapper, step)
        want = grads_of(reference, *global_batch(step))
        if first_bad_step is None and differing(got, want):
            first_bad_step = step
        for optimizer in optimizers:
            optimizer.step()
    diff, worst = max_abs_diff(dict(model.named_parameters()),
                               dict(reference.named_parameters()))
    if diff <= TOL:
        return passed(diff=diff)
    if first_bad_step:
        return failed(f"{worst} is off: grads were right at step 0, wrong from step "
                      f"{first_bad_step}: reset per-step state (ready counts, launched "
                      "buckets) in finish_gradient_sync", diff)
    return failed(f"{worst} is off after {NUM_STEPS} steps (grads wrong from step 0: see "
                  "the checks above)", diff)


EXERCISE = Exercise(
    name="ddp",
    stub="ddp.py",
    entry_points=("make_ddp", "finish_gradient_sync"),
    checks=(
        Check("params and buffers equal rank 0's after construction", check_broadcast),
        Check("grads equal one process (per-parameter)", make_grads_check(None)),
        Check("grads equal one process (buckets of 1 KiB)", make_grads_check(1024)),
        Check("grads equal one process (buckets of 8 KiB)", make_grads_check(8192)),
        Check("tied weight (embedding = output layer) reduced once", check_tied),
        Check("frozen params untouched, their .grad stays None", check_frozen),
        Check("one all-reduce per bucket", check_bucket_count),
        Check("all-reduces overlap backward (async, from hooks)", check_overlap),
        Check(f"params equal one process after {NUM_STEPS} SGD steps", check_training),
    ),
    hints=(("doesn't require gradient",
            "a frozen parameter? skip parameters with requires_grad=False"),),
)
