"""Per-rank memory of the persistent training state: parameters, gradients, optimizer state.

Predicts what each rank holds under DDP and the three ZeRO stages (FSDP = ZeRO-3), from the
parameter count, the dtypes, the optimizer and the world size. Stdlib only, so it can be copied
anywhere; lesson 02 checks it against what lab02 measures, and the OOM runbook uses it.

    python labs/memory_estimator.py --params 70e9 --world-size 64
    python labs/memory_estimator.py --params 8e9 --world-size 8 --param-bytes 2 --grad-bytes 2 \\
        --master-weights          # bf16 params and grads, fp32 master copy in the optimizer

Strategy   params      grads       optimizer state   (P = parameters, N = world size)
  ddp      P           P           P                 full replica everywhere
  zero1    P           P           P / N             ZeroRedundancyOptimizer
  zero2    P           P / N       P / N             grads reduce-scattered, not all-reduced
  zero3    P / N       P / N       P / N             fully_shard (FSDP); alias "fsdp"

The figure is the state that lives between steps (gradients from backward until the optimizer
step). It is a floor, not a peak: see LEFT_OUT for what a real run adds on top.
"""

import argparse
import math
import sys
from dataclasses import dataclass

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ALIASES = {"fsdp": "zero3"}

# Optimizer state tensors kept per parameter element (each optimizer_state_bytes wide).
STATES_PER_PARAM = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}

LEFT_OUT = (
    "activations saved for backward (grow with batch x sequence; checkpointing cuts them)",
    "the transient unsharded unit: under zero3 one block's full params (and grads in backward)",
    "its prefetch: the next block all-gathered while this one computes (so ~2 units at once)",
    "communication buffers: all-gather / reduce-scatter outputs, DDP's gradient buckets",
    "allocator fragmentation and cached-but-free blocks",
    "the CUDA context and NCCL's internal buffers (hundreds of MiB per process)",
    "low-precision compute copies made by autocast or MixedPrecisionPolicy",
)


@dataclass(frozen=True)
class MemoryEstimate:
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self):
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def canonical_strategy(strategy):
    name = ALIASES.get(strategy, strategy)
    if name not in STRATEGIES:
        allowed = ", ".join(STRATEGIES + tuple(ALIASES))
        raise ValueError(f"strategy must be one of {allowed}; got {strategy!r}")
    return name


def sharded_numel(num_params, world_size, shapes=None):
    """Elements of the largest per-rank shard. Without shapes: an even split, ceil(P / N).
    With shapes: FSDP2's layout, every parameter split on dim 0 and padded to
    ceil(dim0 / N) rows on every rank, so small or odd dim-0 sizes cost extra."""
    if shapes is None:
        return math.ceil(num_params / world_size)
    return sum(math.ceil(shape[0] / world_size) * math.prod(shape[1:]) if shape else 1
               for shape in map(tuple, shapes))


def estimate_per_rank(num_params, world_size, strategy, *, param_bytes=4, grad_bytes=4,
                      optimizer="adamw", optimizer_state_bytes=4, master_weights=False,
                      shapes=None):
    """Bytes one rank holds for params, grads and optimizer state (the largest rank when
    shards are uneven). master_weights adds an fp32 copy of the params to the optimizer state,
    as mixed-precision training with low-precision params needs."""
    strategy = canonical_strategy(strategy)
    if optimizer not in STATES_PER_PARAM:
        raise ValueError(f"optimizer must be one of {', '.join(STATES_PER_PARAM)}; got {optimizer!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if shapes is not None:
        shapes = [tuple(int(d) for d in s) for s in shapes]
        from_shapes = sum(math.prod(s) for s in shapes)
        if num_params is None:
            num_params = from_shapes
        elif int(num_params) != from_shapes:
            raise ValueError(f"num_params {num_params} != {from_shapes}, the sum over shapes")
    num_params = int(num_params)
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    full, shard = num_params, sharded_numel(num_params, world_size, shapes)
    optimizer_per_param = (STATES_PER_PARAM[optimizer] * optimizer_state_bytes
                           + (4 if master_weights else 0))
    params_numel = shard if strategy == "zero3" else full
    grads_numel = shard if strategy in ("zero2", "zero3") else full
    optimizer_numel = full if strategy == "ddp" else shard
    return MemoryEstimate(params_bytes=params_numel * param_bytes,
                          grads_bytes=grads_numel * grad_bytes,
                          optimizer_bytes=optimizer_numel * optimizer_per_param)


def table(num_params, world_size, **kwargs):
    """Decimal GB (what vendors print on the box) with binary GiB (what allocators report)."""
    header = ("params", "grads", "optimizer", "total GB", "total GiB")
    lines = [f"{num_params:,} params, world size {world_size}, bytes per rank:",
             f"{'strategy':10s}" + "".join(f"{h:>12s}" for h in header)]
    for strategy in STRATEGIES:
        est = estimate_per_rank(num_params, world_size, strategy, **kwargs)
        cells = [f"{b / 1e9:.2f} GB" for b in (est.params_bytes, est.grads_bytes,
                                                est.optimizer_bytes, est.total_bytes)]
        cells.append(f"{est.total_bytes / 2**30:.2f} GiB")
        lines.append(f"{strategy:10s}" + "".join(f"{c:>12s}" for c in cells))
    lines.append("Not counted (a floor, not a peak):")
    lines += [f"  - {item}" for item in LEFT_OUT]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arg = parser.add_argument
    arg("--params", type=float, required=True, help="parameter count, e.g. 70e9")
    arg("--world-size", type=int, required=True, help="ranks that share the model state")
    arg("--param-bytes", type=int, default=4, help="bytes per parameter (4 fp32, 2 bf16)")
    arg("--grad-bytes", type=int, default=4, help="bytes per gradient element")
    arg("--optimizer", choices=sorted(STATES_PER_PARAM), default="adamw",
        help="adam/adamw keep 2 states per parameter, sgd-momentum 1, sgd 0")
    arg("--optimizer-state-bytes", type=int, default=4, help="bytes per optimizer state element")
    arg("--master-weights", action="store_true",
        help="the optimizer also keeps an fp32 copy of the parameters (+4 B per parameter)")
    args = parser.parse_args(argv)
    if args.params <= 0 or args.world_size < 1:
        print(f"{parser.prog}: error: --params must be > 0 and --world-size >= 1", file=sys.stderr)
        sys.exit(2)
    print(table(int(args.params), args.world_size, param_bytes=args.param_bytes,
                grad_bytes=args.grad_bytes, optimizer=args.optimizer,
                optimizer_state_bytes=args.optimizer_state_bytes,
                master_weights=args.master_weights))


if __name__ == "__main__":
    main()
