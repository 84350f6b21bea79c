"""--check-parity: after training, rank 0 retrains the same global batches in one process,
with no communication at all, and compares every parameter. fp32 on CPU must agree within
--parity-tol (1e-5): that is the proof that the parallel run computes what one process
would."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from labkit.data import micro_batches
from labkit.errors import fail_config, refuse_negative
from labkit.loop import set_learning_rate
from labkit.model import build_model, loss_fn
from labkit.runtime import compute_dtype, pick_device_type


def add_parity_args(parser):
    arg = parser.add_argument
    arg("--check-parity", action="store_true",
        help="retrain in one process on the same global batches and compare parameters")
    arg("--parity-tol", type=float, default=1e-5, help="max |param diff| allowed by --check-parity")
    arg("--parity-dtype", choices=["float32", "float64"], default="float32",
        help="dtype of this run and the reference under --check-parity: float64 removes "
             "rounding, to tell a bug (a gap in both) from rounding (a gap in float32 only)")


def validate_parity_args(cfg):
    refuse_negative(cfg, ["parity_tol"])
    if cfg.parity_dtype == "float64" and not cfg.check_parity:
        fail_config("--parity-dtype", "float64 applies to --check-parity only")
    if cfg.check_parity and not cfg.plan and compute_dtype(cfg, pick_device_type(cfg)) is not None:
        fail_config("--check-parity", "needs fp32 (--amp off): bf16/fp16 rounding is far above 1e-5")


class Reference:
    """What the single-process run builds and minimises: the kit's model and loss, with each
    micro-batch of each rank accumulated in turn. A lab whose model or loss differs subclasses
    it (lab08: a mixture of experts, and a loss over every rank's micro-batch at once)."""

    # True: each micro-step is every rank's micro-batch of that micro-step at once, for a loss
    # that couples them (lab08's balancing loss counts the routing of all of them).
    joint_micro_steps = False

    def build(self, cfg):
        return build_model(cfg)

    def loss(self, model, logits, targets):
        return loss_fn(logits, targets)

    def report(self):
        """Extra metrics fields, read after the reference has trained."""
        return {}


def global_batches(cfg, world_size, joint=False):
    """The global batch whose mean gradient the parallel run's all-reduce (or reduce-scatter)
    computes: every rank's micro-batches of each step, rank by rank (joint: each micro-step's
    micro-batches of every rank, concatenated in rank order)."""
    streams = [micro_batches(cfg, r, world_size, 0) for r in range(world_size)]
    while True:
        if joint:
            inputs, targets = zip(*(next(stream) for stream in streams))
            yield torch.cat(inputs), torch.cat(targets)
            continue
        for stream in streams:
            for _ in range(cfg.grad_accum):
                yield next(stream)


def reference_step(model, optimizer, batches, num_micro, cfg, device, reference):
    """One step; returns (its loss, the gradient norm before clipping, or None)."""
    total = 0.0
    for _ in range(num_micro):
        inputs, targets = (t.to(device) for t in next(batches))
        loss = reference.loss(model, model(inputs), targets) / num_micro
        loss.backward()
        total += loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip) if cfg.clip else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total.item(), norm


def train_reference(cfg, world_size, device, reference):
    """The single-process run the parallel one must match: same init, same schedule, and each
    step accumulates all world_size x grad_accum micro-batches of the global batch. Returns
    the model, each step's loss, and each step's gradient norm (if --clip)."""
    torch.manual_seed(cfg.seed)
    model = reference.build(cfg).to(device)
    model.init_weights(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    joint = reference.joint_micro_steps
    batches = global_batches(cfg, world_size, joint)
    num_micro = cfg.grad_accum if joint else world_size * cfg.grad_accum
    losses, norms = [], []
    for step in range(1, cfg.steps + 1):
        set_learning_rate([optimizer], cfg, step)
        loss, norm = reference_step(model, optimizer, batches, num_micro, cfg, device, reference)
        losses.append(loss)
        norms += [norm.item()] if norm is not None else []
    return model, losses, norms


def check_parity(cfg, full_state, world_size, device, reference=None):
    """Rank 0, after training: the reference's metrics fields and the worst parameter
    difference. full_state: {name: full tensor} of the parallel run, with the single-process
    model's names."""
    reference = reference or Reference()
    model, ref_losses, ref_norms = train_reference(cfg, world_size, device, reference)
    max_diff = max((full_state[name].to(device) - param).abs().max().item()
                   for name, param in model.named_parameters())
    return {"reference_losses": ref_losses, "reference_grad_norms": ref_norms,
            "parity_max_abs_diff": max_diff, **reference.report()}, max_diff


# Float reassociation moves gradient norms by ~1e-6 (relative) over 40 steps; a wrong gradient
# divide factor (lab08's experts at dp instead of dp x ep) moves them by 1e-2 and more.
GRAD_NORM_RTOL = 1e-4


def grad_norm_diff(norms, ref_norms):
    """Max relative difference of each step's gradient norm from the reference's (after a
    resume, the run's steps are the reference's last ones). Unlike the parameters, which
    AdamW makes nearly blind to a gradient's scale, this sees a wrong divide factor."""
    theirs = ref_norms[-len(norms):] if norms else []
    return max((abs(a - b) / b for a, b in zip(norms, theirs)), default=None)


def exit_if_grad_norms_differ(diff):
    if diff is not None and diff > GRAD_NORM_RTOL:
        sys.exit(f"parity check failed: gradient norms differ from the reference by {diff:.2e} "
                 f"(relative) > {GRAD_NORM_RTOL:.0e}")


def exit_if_parity_fails(parity, tolerance, detail=""):
    if parity is not None and parity > tolerance:
        sys.exit(f"parity check failed: max |param diff| {parity:.2e} > {tolerance:.0e}{detail}")


# Pipelines: each rank holds different layers, so every rank checks its own against the
# (small) reference, and one all-reduce finds the worst.
def named_full_tensors(modules, grads=False):
    """{name: full tensor} of this rank's parameters (or their gradients). With FSDP,
    full_tensor() all-gathers the shards over dp: every dp rank calls it in the same order."""
    out = {}
    for module in modules:
        for name, param in module.named_parameters():
            value = param.grad if grads else param
            if value is not None:
                value = value.full_tensor() if isinstance(value, DTensor) else value
                out[name] = value.detach().cpu().clone()  # clipping is in place
    return out


class FirstStepGrads:
    """For --check-parity on a pipeline: every gradient this rank holds, in full, right after
    the run's first schedule.step() (before clipping), if that is step 1 (a resumed run has
    none). It wraps the schedule's step; the lab's step holds no parity code."""

    def __init__(self, cfg, stages, schedule, start_step):
        self.values = {}
        if not cfg.check_parity or start_step != 0:
            return
        step = schedule.step

        def step_then_capture(*args, **kwargs):
            out = step(*args, **kwargs)
            self.values = named_full_tensors([s.submod for s in stages], grads=True)
            schedule.step = step  # once
            return out
        schedule.step = step_then_capture


def train_pipeline_reference(cfg, num_steps, order):
    """The single-process run a pipeline must match: the whole model, same init, and each
    step accumulates the gradient of every microbatch of every dp replica in one process, then
    divides by their number (what scale_grads and FSDP's reduce-scatter average compute).
    `order` is the microbatch order the stage accumulated in (LoopedBFS runs backward last
    microbatch first): fp32 sums depend on order, and Adam turns a last-bit difference in a
    gradient entry near zero into a visible parameter difference."""
    model = build_model(cfg)
    model.init_weights(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    streams = [micro_batches(cfg, r, cfg.dp, 0) for r in range(cfg.dp)]
    num_chunks = cfg.dp * cfg.microbatches
    losses, first_grads = [], None
    for step in range(1, num_steps + 1):
        total = 0.0
        for stream in streams:
            inputs, targets = next(stream)
            chunks = list(zip(inputs.chunk(cfg.microbatches), targets.chunk(cfg.microbatches)))
            for x, y in (chunks[k] for k in order):
                loss = loss_fn(model(x), y)
                loss.backward()
                total += loss.item() / num_chunks
        for p in model.parameters():
            p.grad.div_(num_chunks)
        if step == 1:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if cfg.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        set_learning_rate([optimizer], cfg, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return dict(model.named_parameters()), first_grads, losses


def check_pipeline_parity(cfg, stages, first_grads, losses, order, compare=True):
    """Every rank that compares (all of them, unless compare=False: lab05 leaves it to one
    rank per pp rank) retrains the (small) reference itself and compares the parameters it
    holds; one all-reduce MAX gives the worst difference anywhere. order: the microbatch order
    this rank's first stage accumulated gradients in. For finish_run's own_parity: returns
    (metrics fields, the worst difference, what it is the worst of)."""
    modules = [s.submod for s in stages]
    params = named_full_tensors(modules)  # with FSDP or TP a collective: every rank calls it
    device = next(modules[0].parameters()).device  # NCCL reduces only tensors on the GPU
    worst, ref_losses = [-1.0] * 3, None  # -1: nothing compared here
    if compare:
        ref_params, ref_grads, ref_losses = train_pipeline_reference(cfg, losses[-1][0], order)
        worst = [max((params[n] - ref_params[n].detach()).abs().max().item() for n in params),
                 max(((first_grads[n] - ref_grads[n]).abs().max().item() for n in first_grads),
                     default=-1.0),  # -1: no step 1 in this run (resumed)
                 max(abs(loss - ref_losses[step - 1]) for step, loss in losses)]
    worst = torch.tensor(worst, dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    param_diff, grad_diff, loss_diff = worst.tolist()
    grad_diff = None if grad_diff < 0 else grad_diff  # resumed: no step 1 here
    fields = {"parity_max_abs_diff": param_diff, "reference_losses": ref_losses,
              "grad_parity_max_abs_diff": grad_diff, "loss_parity_max_abs_diff": loss_diff}
    detail = (f" (the worst of params {param_diff:.1e}, step-1 grads {grad_diff}, "
              f"losses {loss_diff:.1e})")
    return fields, max(d for d in (param_diff, grad_diff, loss_diff) if d is not None), detail
