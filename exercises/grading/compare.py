"""Comparing a rank's tensors with the single-process reference, and saying how they differ."""

import math

import torch

# fp32 on CPU: the same sums in another order differ by ~1e-7; any bug is orders above this.
TOL = 1e-5


def max_abs_diff(got, want):
    """(max |got - want| over every name of `want`, the name where it is largest). A name
    missing from `got`, or None there, counts as infinitely far."""
    worst, worst_name = 0.0, None
    for name, expected in want.items():
        actual = got.get(name)
        diff = math.inf if actual is None else (actual - expected).abs().max().item()
        if worst_name is None or diff > worst:
            worst, worst_name = diff, name
    return worst, worst_name


def differing(got, want):
    """The names of `want` where `got` is off by more than TOL (or missing)."""
    return [name for name in want if max_abs_diff({name: got.get(name)},
                                                  {name: want[name]})[0] > TOL]


def scale_of(got, want):
    """c when every tensor of `got` is c times its partner in `want` (a least-squares fit
    whose residual is under 0.1%), else None: "your grads are 0.50x the reference"."""
    dot = sum((g * w).sum().item() for g, w in zip(got, want))
    norm = sum((w * w).sum().item() for w in want)
    if norm == 0:
        return None
    scale = dot / norm
    residual = math.sqrt(sum(((g - scale * w) ** 2).sum().item() for g, w in zip(got, want)))
    size = math.sqrt(sum((g * g).sum().item() for g in got))
    return scale if residual <= 1e-3 * max(size, 1e-12) else None


def same(a, b):
    return a is not None and (a - b).abs().max().item() <= TOL


def format_bytes(num_bytes):
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes} B"


def name_list(names, limit=3):
    names = list(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def state_bytes(optimizer):
    """Bytes of tensors in an optimizer's state (AdamW: exp_avg, exp_avg_sq, step)."""
    return sum(value.numel() * value.element_size()
               for per_param in optimizer.state.values() for value in per_param.values()
               if torch.is_tensor(value))
