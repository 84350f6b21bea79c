"""Checks for exercise pipeline (a pipeline schedule by hand), at 2 ranks and then at 3. The
contract is in exercises/pipeline.py.

Every check builds the same model on every rank from one seed, cut into p stages (rank r keeps
stage r), runs the learner's schedule for one step and compares with one process running the
whole model on the whole batch. The grader's own hooks on the stage see every forward and
backward it really computes; the learner's record() calls say which microbatch each one was.
The grader counts the point-to-point messages with spy.PointToPointSpy.

Every rank runs the same learner calls in the same order, whatever it finds: a rank that
skipped a step would leave its peers waiting in a receive. Results are judged after the runs.

The expected orders are torch.distributed.pipelining's as it runs them (ScheduleGPipe and
Schedule1F1B, _step_microbatches in torch 2.13, checked for p = 2..5 and m = p..9). Torch's
own schedule IR for 1F1B (_get_pipeline_order) lists the last rank's forwards from F1: an
off-by-one in the IR, not in what runs.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .checks import Check, Exercise, failed, passed
from .compare import TOL, differing, max_abs_diff, name_list, scale_of
from .spy import PointToPointSpy

DIM, CLASSES = 16, 4
BATCH = 12  # a multiple of every num_microbatches used below (3 and 4)
SEED = 0
NUM_MICROBATCHES = 4  # the loss check's; the others name theirs
ENTRY = {"gpipe": "run_gpipe", "1f1b": "run_1f1b"}
LABEL = {"gpipe": "GPipe", "1f1b": "1F1B"}


def build_stages(world_size):
    """The whole model, cut into world_size stages; the last one ends with the classifier."""
    torch.manual_seed(SEED)
    stages = [torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh())
              for _ in range(world_size)]
    stages[-1].append(torch.nn.Linear(DIM, CLASSES))
    return stages


def make_batch():
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCH, DIM, generator=generator)
    return inputs, torch.randint(CLASSES, (BATCH,), generator=generator)


def loss_fn(logits, targets):
    return F.cross_entropy(logits, targets)  # the mean over the microbatch's rows


def reference(world_size):
    """(each stage's grads, the loss): one process, the whole model, the whole batch."""
    stages = build_stages(world_size)
    inputs, targets = make_batch()
    loss = loss_fn(torch.nn.Sequential(*stages)(inputs), targets)
    loss.backward()
    return [{name: p.grad for name, p in s.named_parameters()} for s in stages], loss.item()


def expected_order(schedule, rank, world_size, num_microbatches):
    """[(action, microbatch)] on `rank`: GPipe, or 1F1B with min(m, p - rank) warm-up forwards
    then one backward and one forward at a time."""
    m = num_microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    num_warmup = min(m, world_size - rank)
    order = [("F", i) for i in range(num_warmup)]
    for i in range(m):
        order.append(("B", i))
        if num_warmup + i < m:
            order.append(("F", num_warmup + i))
    return order


def run_schedule(ctx, schedule, num_microbatches):
    """One step of the learner's schedule on this rank's stage: its grads, the value it
    returned, its record() calls, what the stage computed ("F"/"B") and its messages."""
    stage = build_stages(ctx.world_size)[ctx.rank]
    records, computed = [], []

    def on_forward(module, args, output):
        computed.append("F")
        if output.requires_grad:  # this hook fires when backward reaches the stage's output
            output.register_hook(lambda grad: computed.append("B"))

    def record(action, microbatch):
        if action not in ("F", "B"):
            raise ValueError(f"record({action!r}, {microbatch!r}): the action is 'F' or 'B'")
        records.append((action, int(microbatch)))

    stage.register_forward_hook(on_forward)
    inputs, targets = make_batch()
    with PointToPointSpy() as spy:
        loss = ctx.entry(ENTRY[schedule])(stage, inputs, targets, loss_fn, num_microbatches,
                                          record)
    grads = {name: p.grad for name, p in stage.named_parameters()}
    return SimpleNamespace(grads=grads, loss=loss, records=records, computed=computed, spy=spy)


def spaced(order):
    return " ".join(f"{action}{i}" for action, i in order)


def explain_grads(ctx, got, want, num_microbatches):
    """Why this stage's grads differ from one process's, in terms of the usual mistakes."""
    rank, wrong = ctx.rank, differing(got, want)
    missing = [name for name in wrong if got.get(name) is None]
    if missing or all(got[name].abs().max() == 0 for name in wrong):
        what = "None" if missing else "zero"
        if rank == ctx.world_size - 1:
            return (f"the last stage's .grad is {what}: backward each microbatch's "
                    "loss_fn(output, targets) / num_microbatches")
        return (f"stage {rank}'s .grad is {what}: no gradient came back from stage {rank + 1}. "
                "Autograd stops at the process boundary: the next stage marks the activation "
                "it received with requires_grad_(), sends its .grad back after its backward, "
                "and this stage calls output.backward(that gradient)")
    scale = scale_of([got[n] for n in wrong], [want[n] for n in wrong])
    times = f"{scale:.2f}x the reference" if scale is not None else "not a multiple of it"
    if scale is not None and abs(scale - num_microbatches) < 1e-3 * num_microbatches:
        return (f"your grads are {times}: divide each microbatch's loss by num_microbatches "
                "(the loss is the mean over the whole batch, not the sum of microbatch means)")
    if scale is not None and abs(scale * num_microbatches - 1) < 1e-3:
        return f"your grads are {times}: divided by num_microbatches twice?"
    return f"wrong for {name_list(wrong)} ({times})"


def make_grads_check(schedule, num_microbatches):
    def check_grads(ctx):
        run = run_schedule(ctx, schedule, num_microbatches)
        want = reference(ctx.world_size)[0][ctx.rank]
        diff, _ = max_abs_diff(run.grads, want)
        if diff <= TOL:
            return passed(diff=diff)
        return failed(explain_grads(ctx, run.grads, want, num_microbatches), diff)
    return check_grads


def check_loss(ctx):
    runs = {schedule: run_schedule(ctx, schedule, NUM_MICROBATCHES) for schedule in ENTRY}
    want = reference(ctx.world_size)[1]
    if ctx.rank != ctx.world_size - 1:
        return passed(f"one process's loss {want:.6f}")  # only the last stage's value counts
    worst = 0.0
    for schedule, run in runs.items():
        if run.loss is None:
            return failed(f"{LABEL[schedule]}: the last stage returned None: return the mean "
                          "loss over the whole batch")
        try:
            got = float(run.loss)
        except (TypeError, ValueError, RuntimeError):
            return failed(f"{LABEL[schedule]}: the last stage returned {type(run.loss).__name__}"
                          ": return the mean loss as a float or a 0-d tensor")
        diff = abs(got - want)
        worst = max(worst, diff)
        if diff > TOL:
            hint = (": the sum of the microbatch losses? return their mean (sum / "
                    "num_microbatches)" if abs(got - NUM_MICROBATCHES * want) < 1e-4 else "")
            return failed(f"{LABEL[schedule]}: the last stage returned {got:.6f}, one process's "
                          f"loss is {want:.6f}{hint}", diff)
    return passed(f"one process's loss {want:.6f}", worst)


def explain_order(schedule, got, want, rank, world_size, num_microbatches):
    m = num_microbatches
    forwards_first = all(a == "F" for a, _ in got[:m]) and all(a == "B" for a, _ in got[m:])
    if schedule == "gpipe":
        backwards = [i for a, i in got if a == "B"]
        if forwards_first and backwards == list(range(m))[::-1]:
            return (f"backwards in reverse microbatch order ({spaced(got[m:])}): in this "
                    "exercise GPipe runs them in microbatch order, B0 first, as torch's "
                    "ScheduleGPipe does")
        if not forwards_first:
            return f"GPipe runs every forward before any backward: ran {spaced(got)}"
    else:
        num_warmup = next((n for n, (a, _) in enumerate(got) if a == "B"), len(got))
        expected_warmup = min(m, world_size - rank)
        if num_warmup != expected_warmup:
            return (f"a warm-up of {num_warmup} forwards on stage {rank}; 1F1B warms up with "
                    f"min(m, p - rank) = {expected_warmup} on this stage, then runs one backward "
                    f"and one forward at a time: ran {spaced(got)}, expected {spaced(want)}")
    return f"ran {spaced(got)}, expected {spaced(want)}"


def make_order_check(schedule, num_microbatches):
    def check_order(ctx):
        run = run_schedule(ctx, schedule, num_microbatches)
        orders = ctx.gather(spaced(run.records))  # every rank gathers, whatever it found
        got, computed = run.records, run.computed
        want = expected_order(schedule, ctx.rank, ctx.world_size, num_microbatches)
        if not got:
            return failed("record() was never called: call record('F', i) right before each "
                          "microbatch's forward and record('B', i) before its backward")
        num_recorded = sum(a == "B" for a, _ in got)
        if computed.count("B") < num_recorded:
            return failed(f"record('B', i) was called {num_recorded} times but backward reached "
                          f"this stage's output {computed.count('B')} times: every microbatch's "
                          "backward runs through every stage (see the grads checks)")
        if [a for a, _ in got] != computed:
            return failed(f"record() said {' '.join(a for a, _ in got)} but the stage computed "
                          f"{' '.join(computed)}: call record(action, i) right before the "
                          "forward or backward it names")
        if got != want:
            return failed(explain_order(schedule, got, want, ctx.rank, ctx.world_size,
                                        num_microbatches))
        return passed(" | ".join(orders))
    return check_order


def most_in_flight(computed):
    """The most microbatches whose forward had run and whose backward had not, at any time."""
    held = most = 0
    for action in computed:
        held += 1 if action == "F" else -1
        most = max(most, held)
    return most


def make_in_flight_check(num_microbatches):
    def check_in_flight(ctx):
        run = run_schedule(ctx, "1f1b", num_microbatches)
        most = most_in_flight(run.computed)
        per_rank = ctx.gather(most)
        limit = min(num_microbatches, ctx.world_size - ctx.rank)
        num_forward, num_backward = run.computed.count("F"), run.computed.count("B")
        if num_backward < num_forward:
            return failed(f"stage {ctx.rank} computed {num_forward} forwards but only "
                          f"{num_backward} backwards: every microbatch runs backward through "
                          "every stage (see the grads checks)")
        if most > limit:
            return failed(f"stage {ctx.rank} held {most} microbatches' activations at once "
                          "(forwards whose backward had not run yet); 1F1B holds at most "
                          f"min(m, p - rank) = {limit} here: a longer warm-up than p - rank?")
        return passed(f"most held at once per rank: {', '.join(map(str, per_rank))} (GPipe: "
                      f"{num_microbatches} on every rank)")
    return check_in_flight


def explain_messages(spy, label, rank, world_size, m):
    """What is off in one step's messages on this rank, or None."""
    neighbours = {rank - 1, rank + 1} & set(range(world_size))
    strangers = sorted({msg.peer for msg in spy.messages} - neighbours)
    if not spy.messages:
        return (f"{label}: no point-to-point message seen on stage {rank}: send the "
                "activations and gradients with dist.send / recv, isend / irecv or "
                "batch_isend_irecv (the grader counts those)")
    if strangers:
        return (f"{label}: stage {rank} exchanged messages with rank {strangers[0]}: a stage "
                "talks only to the stages before and after it")
    expected = [("send", rank + 1, "activations to", rank < world_size - 1),
                ("recv", rank - 1, "activations from", rank > 0),
                ("send", rank - 1, "gradients back to", rank > 0),
                ("recv", rank + 1, "gradients from", rank < world_size - 1)]
    for kind, peer, what, needed in expected:
        got, want = spy.count(kind, peer), m if needed else 0
        if got != want:
            verb = "sent" if kind == "send" else "received"
            return (f"{label}: stage {rank} {verb} {got} {what} stage {peer} in one step, "
                    f"expected {want}, one per microbatch")
    return None


def make_messages_check(num_microbatches):
    def check_messages(ctx):
        runs = {schedule: run_schedule(ctx, schedule, num_microbatches) for schedule in ENTRY}
        counts = ctx.gather([len(run.spy.messages) for run in runs.values()])
        for schedule, run in runs.items():
            problem = explain_messages(run.spy, LABEL[schedule], ctx.rank, ctx.world_size,
                                       num_microbatches)
            if problem:
                return failed(problem)
        total = sum(per_rank[0] for per_rank in counts)  # sends and receives, one schedule
        want = 2 * (ctx.world_size - 1) * num_microbatches
        return passed(f"GPipe and 1F1B: {total // 2} sends and {total // 2} receives per step "
                      f"across {ctx.world_size} ranks, 2(p-1)m = {want}")
    return check_messages


EXERCISE = Exercise(
    name="pipeline",
    stub="pipeline.py",
    entry_points=("run_gpipe", "run_1f1b"),
    checks=(
        Check("GPipe: grads equal one process (m=4)", make_grads_check("gpipe", 4)),
        Check("GPipe: order F0..F3, then B0..B3", make_order_check("gpipe", 4)),
        Check("1F1B: grads equal one process (m=4)", make_grads_check("1f1b", 4)),
        Check("1F1B: grads equal one process (m=3, not a multiple of p)",
              make_grads_check("1f1b", 3)),
        Check("1F1B: order (p - rank warm-up forwards, then B and F in turn)",
              make_order_check("1f1b", 4)),
        Check("1F1B: at most p - rank microbatches in flight per rank",
              make_in_flight_check(4)),
        Check("loss returned by the last stage equals one process's", check_loss),
        Check("2(p-1)m sends and receives per step", make_messages_check(4)),
        Check("GPipe, 3 ranks: grads equal one process (m=4)", make_grads_check("gpipe", 4), 3),
        Check("1F1B, 3 ranks: grads equal one process (m=4)", make_grads_check("1f1b", 4), 3),
        Check("1F1B, 3 ranks: order", make_order_check("1f1b", 4), 3),
        Check("1F1B, 3 ranks: at most p - rank in flight", make_in_flight_check(4), 3),
        Check("2(p-1)m sends and receives per step, 3 ranks", make_messages_check(4), 3),
    ),
    hints=(("but got <class 'NoneType'>",
            "sending a .grad that is None? mark the received activation with requires_grad_() "
            "before the stage's forward, so backward fills its .grad"),),
)
