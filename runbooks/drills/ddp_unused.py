"""Drill: DDP parameters that get no gradient, and the ways to fix it.

Symptom reproduced: the second forward raises
    RuntimeError: Expected to have finished reduction in the prior iteration before starting a
    new one. This error indicates that your module has parameters that were not used in
    producing loss. ...
DDP waits, in every backward, for a gradient of every parameter that requires one. A parameter
outside the loss never delivers it, so that step's reduction never finishes, and DDP notices at
the start of the *next* forward. The error lists the parameters' indices; with
TORCH_DISTRIBUTED_DEBUG=INFO (or DETAIL set by dist.set_debug_level, --set-debug-level) it
names them: "Parameters which did not receive grad for rank 0: aux_head.bias, aux_head.weight".
On torch 2.13 + gloo, TORCH_DISTRIBUTED_DEBUG=DETAIL in the environment crashes the DDP
constructor itself (SIGSEGV; faulthandler prints the Python stack): see the runbook.

Causes (--cause):
  not-called   aux_head exists but forward never runs it (a head kept for later, a module
               replaced but not deleted, a head run under torch.no_grad()) (the default)
  output       forward runs aux_head and returns its output; the loss leaves it out
  branch       aux_head runs only on even steps, on every rank (a data-dependent `if`)
  rank-branch  one rank (--skip-rank) skips aux_head on step 1: that rank raises at its next
               forward, while the others wait for its all-reduce (bounded by --timeout-s)
  none         every parameter is used (with --fix find-unused: the "extra traversal" warning)
Fixes (--fix):
  none          plain DDP(model)
  find-unused   DDP(model, find_unused_parameters=True): after each forward, DDP walks the
                autograd graph and marks the parameters it cannot reach as ready
  static-graph  DDP(model, static_graph=True): DDP records the first iteration and expects
                the same graph ever after (fails for branch, rank-branch and output)
  use-output    every parameter contributes to the loss every step (aux_head always runs;
                weight 0 where its term is not wanted)
  freeze        aux_head.requires_grad_(False) before wrapping: DDP ignores frozen parameters
--fix takes a comma-separated list too (e.g. find-unused,static-graph): each fix then trains
a fresh model in turn, in the same processes, and the run stops at the first one that fails.
Each fix that completes ends by checking that the parameters are identical on every rank.

Run (CPU, gloo, 2 ranks; every case ends within seconds):
    torchrun --standalone --nproc-per-node 2 runbooks/drills/ddp_unused.py
    TORCH_DISTRIBUTED_DEBUG=INFO torchrun --standalone --nproc-per-node 2 \\
        runbooks/drills/ddp_unused.py
    torchrun --standalone --nproc-per-node 2 runbooks/drills/ddp_unused.py --fix find-unused
    torchrun --standalone --nproc-per-node 2 runbooks/drills/ddp_unused.py --cause rank-branch
Runbook: runbooks/ddp-unused-parameters.md. Lesson: lessons/01_ddp.py ("What DDP users run into").
"""

import argparse
import datetime
import faulthandler
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

CAUSES = ["not-called", "output", "branch", "rank-branch", "none"]
FIXES = ["none", "find-unused", "static-graph", "use-output", "freeze"]


def fix_list(text):
    fixes = text.split(",")
    for fix in fixes:
        if fix not in FIXES:
            raise argparse.ArgumentTypeError(f"{fix!r} is not one of {', '.join(FIXES)}")
    return fixes


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cause", choices=CAUSES, default="not-called",
                        help="why a parameter gets no gradient (see the module docstring)")
    parser.add_argument("--fix", type=fix_list, default=["none"],
                        help=f"the fix, or a comma-separated list of fixes run in turn: "
                             f"{', '.join(FIXES)}")
    parser.add_argument("--steps", type=int, default=4, help="training steps per fix")
    parser.add_argument("--layers", type=int, default=1,
                        help="Linear+ReLU layers in the trunk (more autograd nodes to traverse)")
    parser.add_argument("--skip-rank", type=int, default=1,
                        help="--cause rank-branch: the rank that skips aux_head on step 1")
    parser.add_argument("--set-debug-level", choices=["INFO", "DETAIL"], default=None,
                        help="call dist.set_debug_level() after init_process_group (DDP then "
                             "names the parameters; the group itself is not wrapped)")
    parser.add_argument("--timeout-s", type=float, default=5.0,
                        help="init_process_group timeout: bounds the rank-branch wait")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.layers < 1 or args.timeout_s <= 0:
        parser.exit(2, "ddp_unused.py: error: --steps must be >= 2, --layers >= 1 and "
                       "--timeout-s > 0\n")
    return args


class TwoHeads(nn.Module):
    """A trunk with a main head and an auxiliary head (the parameters that go missing)."""

    def __init__(self, num_layers=1):
        super().__init__()
        self.trunk = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU())
                                     for _ in range(num_layers)])
        self.head = nn.Linear(16, 4)
        self.aux_head = nn.Linear(16, 4)

    def forward(self, x, use_aux=True):
        hidden = self.trunk(x)
        return self.head(hidden), (self.aux_head(hidden) if use_aux else None)


def runs_aux(cause, step, rank, skip_rank):
    """Does forward run aux_head on this step, on this rank?"""
    if cause == "not-called":
        return False
    if cause == "branch":
        return step % 2 == 0
    if cause == "rank-branch":
        return not (step == 1 and rank == skip_rank)
    return True  # output, none


def loss_of(args, fix, model, x, step, rank):
    wanted = runs_aux(args.cause, step, rank, args.skip_rank)
    if fix == "use-output":
        # Run aux_head every step and keep it in the loss (weight 0 where it is not wanted):
        # every parameter then gets a gradient, and the graph is the same every step.
        main, aux = model(x, use_aux=True)
        weight = 0.1 if wanted else 0.0
        return main.pow(2).mean() + weight * aux.pow(2).mean()
    main, aux = model(x, use_aux=wanted)
    loss = main.pow(2).mean()
    if aux is not None and args.cause != "output":
        loss = loss + 0.1 * aux.pow(2).mean()
    return loss  # --cause output: forward computed and returned aux, the loss dropped it


def wrap(fix, model):
    if fix == "freeze":
        model.aux_head.requires_grad_(False)  # before DDP: DDP only waits for trainable params
    return DDP(model, find_unused_parameters=fix == "find-unused",
               static_graph=fix == "static-graph")


def train(args, fix, rank):
    """Train a fresh model with one fix; False if a step raised or the replicas differ."""
    tag = f"rank {rank}: [{fix}]"
    torch.manual_seed(0)
    print(f"{tag} wrapping the model in DDP", flush=True)
    model = wrap(fix, TwoHeads(args.layers))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(args.steps, 8, 16, generator=torch.Generator().manual_seed(rank))
    step_s = []
    for step in range(args.steps):
        t0 = time.monotonic()
        try:
            loss = loss_of(args, fix, model, data[step], step, rank)
            loss.backward()
        except RuntimeError as exc:
            print(f"{tag} step {step} failed after {time.monotonic() - t0:.1f} s: "
                  f"{type(exc).__name__}: {exc}", flush=True)
            return False
        if step == 0:  # the check to run on your own model, after one backward
            missing = [name for name, p in model.module.named_parameters()
                       if p.requires_grad and p.grad is None]
            print(f"{tag} step 0: parameters with no .grad after backward: "
                  f"{', '.join(missing) or 'none'}", flush=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.monotonic() - t0)
        print(f"{tag} step {step} ok | loss {loss.item():.4f}", flush=True)
    # The first step builds buckets and (find-unused/static-graph) learns the graph: skip it.
    later = sorted(step_s[1:])
    # A fix must keep the replicas identical (gradients averaged on every step).
    flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], other) for other in gathered)
    print(f"{tag} {args.steps} steps ok | median step after the first "
          f"{1000 * later[len(later) // 2]:.2f} ms | parameters identical on every rank: "
          f"{same}", flush=True)
    return same


def main(argv=None):
    args = parse_args(argv)
    faulthandler.enable()  # a crash inside torch's C++ then still prints the Python stack
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    if args.set_debug_level:
        dist.set_debug_level(getattr(dist.DebugLevel, args.set_debug_level))
    rank = dist.get_rank()
    print(f"rank {rank}: torch {torch.__version__} | cause {args.cause} | fix "
          f"{','.join(args.fix)} | TORCH_DISTRIBUTED_DEBUG {dist.get_debug_level().name}",
          flush=True)
    for fix in args.fix:
        ok = train(args, fix, rank)
        # Free the DDP model (a reference cycle) before the group goes: a Reducer that
        # outlives destroy_process_group() can abort or hang the exit (exit-hang.md, cause D).
        gc.collect()
        if not ok:
            # A failed reduction leaves the group unusable (a bucket may still be pending):
            # leave without tearing it down.
            sys.stdout.flush()
            os._exit(1)
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
