"""--check-parity: after training, rank 0 retrains the same global batches in one process,
with no communication at all, and compares every parameter. fp32 on CPU must agree within
--parity-tol (1e-5): that is the proof that the parallel run computes what one process
would."""

import sys

import torch

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


def global_batches(cfg, world_size):
    """Every rank's micro-batches of each step, rank by rank: the global batch whose mean
    gradient the parallel run's all-reduce (or reduce-scatter) computes."""
    streams = [micro_batches(cfg, r, world_size, 0) for r in range(world_size)]
    while True:
        for stream in streams:
            for _ in range(cfg.grad_accum):
                yield next(stream)


def reference_step(model, optimizer, batches, num_micro, cfg, device):
    total = 0.0
    for _ in range(num_micro):
        inputs, targets = (t.to(device) for t in next(batches))
        loss = loss_fn(model(inputs), targets) / num_micro
        loss.backward()
        total += loss.detach()
    if cfg.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total.item()


def train_reference(cfg, world_size, device):
    """The single-process run the parallel one must match: same init, same schedule, and each
    step accumulates all world_size x grad_accum micro-batches of the global batch."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg).to(device)
    model.init_weights(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    batches = global_batches(cfg, world_size)
    losses = []
    for step in range(1, cfg.steps + 1):
        set_learning_rate([optimizer], cfg, step)
        losses.append(reference_step(model, optimizer, batches, world_size * cfg.grad_accum,
                                     cfg, device))
    return model, losses


def check_parity(cfg, full_state, world_size, device):
    """(max |param diff| against the reference, the reference's losses). full_state: {name:
    full tensor} of the parallel run, with the single-process model's names."""
    reference, ref_losses = train_reference(cfg, world_size, device)
    max_diff = max((full_state[name].to(device) - param).abs().max().item()
                   for name, param in reference.named_parameters())
    return max_diff, ref_losses


def exit_if_parity_fails(parity, tolerance, detail=""):
    if parity is not None and parity > tolerance:
        sys.exit(f"parity check failed: max |param diff| {parity:.2e} > {tolerance:.0e}{detail}")
