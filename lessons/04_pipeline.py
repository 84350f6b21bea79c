# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Pipeline parallelism
#
# After this lesson you can:
#
# - say what a pipeline sends (activations forward, gradients back, point-to-point only) and
#   why it idles (the bubble), with the formula;
# - run a two-stage pipeline by hand with `dist.send` / `dist.recv` and show it computes the
#   same gradients as one process;
# - cut a model into `PipelineStage`s and run every schedule `torch.distributed.pipelining`
#   offers (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
#   DualPipeV) from `labs/lab04_pipeline.py`;
# - read a measured timeline (a Gantt chart per schedule), compare its bubble with theory and
#   explain the difference;
# - show that 1F1B keeps fewer microbatches of activations alive than GPipe, and combine PP
#   with FSDP (`--dp`).
#
# Everything runs on a laptop CPU over gloo; on GPUs the same lab uses NCCL.

# %%
import argparse
import inspect
import os
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

ROOT = Path(os.environ.get("COURSE_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "labs" / "lab01_ddp.py").exists()))
sys.path.insert(0, str(ROOT / "lessons"))
sys.path.insert(0, str(ROOT / "labs"))

import lab04_pipeline as lab  # noqa: E402  (the lab is importable: nothing runs at import)
import labkit.pipeline  # noqa: E402  (the kit beside the labs: the schedule classes' rules)
import pipeline_workers  # noqa: E402  (worker functions live in a module: spawn re-imports them)
from spawn import launch_lab, run_workers  # noqa: E402

# %% [markdown]
# ## Why
#
# Data parallelism (lessons 01, 02) gives every rank the whole model's *computation*: even
# with FSDP sharding the storage, each rank still runs every layer. Pipeline parallelism (PP)
# cuts the model by layers: rank 0 runs layers 0..k-1, rank 1 the next k, and so on. What
# crosses the cut is one activation tensor per microbatch going forward and its gradient
# coming back, point-to-point between neighbours, no collective at all. That is why PP is the
# parallelism that tolerates slow links (across nodes), and why it is the one to reach for when
# even one layer's worth of FSDP traffic per step is too much.
#
# The price is idle time. Stage 2 cannot start microbatch 0 until stage 1 finished it, and
# stage 1 waits at the end for the gradients to come back. With `p` stages and `m`
# microbatches of equal cost, each rank works `m` slots out of `m + p - 1`, so the **bubble**
# is `(p - 1) / (m + p - 1)` of the step (GPipe, Huang et al. 2019, arXiv:1811.06965):

# %%
def bubble(p, m, v=1):
    """Idle share of a step; v = stages per rank (interleaved), v = 1 otherwise."""
    return (p - 1) / (v * m + p - 1)


for p, m in [(4, 4), (8, 8), (8, 32), (8, 64)]:
    print(f"p={p} stages, m={m:>2} microbatches: bubble {bubble(p, m):.0%}")
assert round(bubble(8, 8), 2) == 0.47 and bubble(8, 32) < 0.18
# 4 stages per rank do what 4x more microbatches do, without making the microbatches smaller:
assert abs(bubble(8, 8, v=4) - bubble(8, 32)) < 1e-12

# %% [markdown]
# Megatron-LM's papers and the Ultra-Scale Playbook write the bubble as `(p - 1) / m`. That is
# not a different claim: it divides the same `p - 1` idle slots by the `m` slots of useful
# compute, where the formula above divides them by the whole step, `m + p - 1`. With
# `r = (p - 1) / m`, the share of the step is `r / (1 + r)`. When `m` is much larger than `p`
# the two agree; at `p = m = 8` one says 88% on top of the compute, the other 47% of the step.
# This course, and lab04's metrics, use the share of the step.

# %%
def bubble_over_compute(p, m, v=1):
    """Idle time relative to the ideal compute time: Megatron-LM's and the Playbook's form."""
    return (p - 1) / (v * m)


for p, m in [(4, 4), (8, 8), (8, 32)]:
    r = bubble_over_compute(p, m)
    print(f"p={p}, m={m:>2}: idle / compute {r:.0%}, idle / step {bubble(p, m):.0%}")
    assert abs(r / (1 + r) - bubble(p, m)) < 1e-12  # the same schedule, two denominators

# %% [markdown]
# Two ways to shrink it: more microbatches (for a fixed batch, smaller ones, so each kernel
# does less work) or `v` thinner stages per rank (*interleaving*): the formula becomes
# `(p - 1) / (v m + p - 1)`, the same as `v` times more microbatches, paid for with `v` times
# more sends.
# The zero-bubble schedules go further by splitting backward in two (input gradient first,
# because the previous stage waits for it; weight gradient later, to fill the gaps).
#
# ## From scratch: two stages by hand
#
# `pipeline_workers.gpipe_by_hand` runs a small MLP cut in two on two processes. Rank 0 runs
# the first half on each microbatch and `dist.send`s the activation; rank 1 `dist.recv`s it,
# finishes the forward and the loss. Then backward: rank 1 sends the gradient with respect to
# its input back, and rank 0 continues the chain rule with `out.backward(grad)`.

# This is the whole by-hand step (`lessons/pipeline_workers.py`). Both ranks stamp times on
# the machine's one monotonic clock, from the earlier rank's start, and each start is stamped
# *after* the receive it waited on, so a wait shows as a gap, never as work:

# %%
print(inspect.getsource(pipeline_workers.gpipe_by_hand))

# %%
BATCH, MICRO = 64, 4
rank0, rank1 = run_workers(pipeline_workers.gpipe_by_hand, 2, BATCH, MICRO, timeout_s=60)
first_grads, second_grads, ref_loss = pipeline_workers.single_process_grads(BATCH)
worst = max(max((rank0["grads"][n] - g).abs().max().item() for n, g in first_grads.items()),
            max((rank1["grads"][n] - g).abs().max().item() for n, g in second_grads.items()))
print(f"pipeline loss {rank1['loss']:.6f} vs one process {ref_loss:.6f}; "
      f"max |grad diff| {worst:.1e}")
assert abs(rank1["loss"] - ref_loss) < 1e-6 and worst < 1e-6

# %% [markdown]
# Same loss, same gradients: dividing each microbatch's loss by `m` and summing the gradients
# is the gradient of the batch mean. Drawn on the shared clock, with the same chart the lab's
# runs get below (colour: the action; label: the microbatch):

# %%
COLORS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:green", "W": "tab:red"}
LABELS = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}


def draw_gantt(ax, ranks, title):
    """ranks[r] = [(kind, microbatch, start_s, end_s), ...]; one row per rank, in ms from the
    first action. Text sizes are chosen to stay readable when the page scales the figure down."""
    t0 = min(start for events in ranks for _, _, start, _ in events)
    span = max(end for events in ranks for _, _, _, end in events) - t0
    for r, events in enumerate(ranks):
        for kind, mb, start, end in events:
            ax.barh(r, (end - start) * 1e3, left=(start - t0) * 1e3, color=COLORS[kind],
                    edgecolor="black", lw=0.4, height=0.8)
            if end - start > 0.025 * span:  # a label only where it fits
                ax.text((start + end - 2 * t0) / 2 * 1e3, r, str(mb), ha="center",
                        va="center", fontsize=10, color="white", fontweight="bold")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))], fontsize=10)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=11, loc="left")
    ax.tick_params(axis="x", labelsize=10)


def gantt_legend(fig, kinds):
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds]
    fig.legend(handles, [LABELS[k] for k in kinds], loc="lower center", ncol=len(kinds),
               fontsize=10, frameon=False)


by_hand = [rank0["events"], rank1["events"]]
fig, ax = plt.subplots(figsize=(8, 2.4))
draw_gantt(ax, by_hand, "GPipe by hand: 2 stages, 4 microbatches")
ax.set_xlabel("ms since rank 0's first forward", fontsize=10)
gantt_legend(fig, "FB")
fig.tight_layout(rect=(0, 0.1, 1, 1))
plt.show()

# Fill and drain, on one clock (the machine's): rank 1 starts microbatch k only after rank 0
# finished it, and rank 0's backward of k only after rank 1's. The receive enforces that
# order, so it holds however busy the machine is.
forward = {(r, mb): (s, e) for r, ev in enumerate(by_hand) for k, mb, s, e in ev if k == "F"}
backward = {(r, mb): (s, e) for r, ev in enumerate(by_hand) for k, mb, s, e in ev if k == "B"}
for mb in range(MICRO):
    assert forward[1, mb][0] > forward[0, mb][1]
    assert backward[0, mb][0] > backward[1, mb][1]
assert forward[0, 0][0] < forward[0, 0][1] < forward[1, 0][0]  # rank 0 starts first; rank 1 waits

# %% [markdown]
# The fill-drain shape: rank 1 idles until rank 0's first activation arrives, and rank 0 idles
# from its last forward until the first gradient comes back; those idle ends are the bubble.
# (Rank 1's bars are longer because its half holds two of the three linear layers and the
# loss. The worker runs one untimed forward and backward first: the first backward in a
# process paid 180 ms of one-off set-up here, which would have hidden everything else.)
#
# ## With PyTorch
#
# `torch.distributed.pipelining` does the bookkeeping: a `PipelineStage` wraps one slice of
# the model and knows its neighbours; a schedule decides the order of forward (F), backward
# (B), and, for zero-bubble schedules, input-gradient (I) and weight-gradient (W) actions, and
# posts the sends and receives. The lab cuts the model by layer index. Because the layers live
# in a `ModuleDict` keyed by index, a stage keeps the whole model's parameter names, so it gets
# the same initial weights as the single-process reference and checkpoints do not depend on
# how the model was cut:

# %%
print(inspect.getsource(lab.build_stage_module))
print(inspect.getsource(lab.cut_stage))  # from the kit: labs/labkit/pipeline.py
print(inspect.getsource(lab.stage_ids_for_rank))

# %% [markdown]
# Which stages a rank holds depends on the schedule: looped schedules put stage `s` on rank
# `s % pp`; the V schedules give rank `r` stages `r` and `2 pp - 1 - r`. Forward runs down the
# ranks and back up, so the turn of the V, from stage `pp - 1` to stage `pp`, happens on the
# last rank, which holds both: that hop needs no send. (Rank 0 holding the first and last
# stages is the other end of the V: the input and the loss live on one rank.) The constraints
# each class enforces (the lab checks them before starting any process group, so a bad
# combination is one line and exit status 2, not a hang):

# %%
for name, spec in lab.SCHEDULES.items():
    fixed = spec["stages_per_rank"] or "V (--stages-per-rank)"
    print(f"{name:22s} placement {spec['placement']:4s} stages/rank {fixed!s:22s} "
          f"microbatches {spec['microbatches']:9s} since torch {spec['since']}")
v_cfg = argparse.Namespace(schedule="ZBVZeroBubble", stages_per_rank=2)
loop_cfg = argparse.Namespace(schedule="Interleaved1F1B", stages_per_rank=2)
assert lab.stage_ids_for_rank(0, 2, v_cfg) == [0, 3] and lab.stage_ids_for_rank(1, 2, v_cfg) == [1, 2]
for pp in (2, 4):  # the turn (stage pp - 1 -> pp) stays on the last rank, whatever pp is
    assert {pp - 1, pp} == set(lab.stage_ids_for_rank(pp - 1, pp, v_cfg))
assert lab.stage_ids_for_rank(0, 2, loop_cfg) == [0, 2]

# %% [markdown]
# ## Run the lab for every schedule
#
# Two ranks, 4 layers, 4 microbatches per step. GPipe and 1F1B run one stage per rank (2
# stages); the others run two stages per rank (4 stages). Each run checks parity with a
# single-process run on the same batches: the loss of every step, every gradient of the first
# step and every parameter after the last, all within 1e-5.
#
# <details><summary>How these runs are launched</summary>
#
# The first run starts real torchrun, as you would; the others fork their ranks from a server
# that has already imported torch (`launch_lab` in `lessons/spawn.py`), about 10 s less
# start-up each on a 2-core laptop.
# </details>

# %%
workdir = Path(tempfile.mkdtemp(prefix="lesson04-"))


def run_lab(nproc, *args, torchrun=False):
    """torchrun --standalone --nproc-per-node nproc labs/lab04_pipeline.py ARGS: real torchrun
    with torchrun=True, else ranks forked as torchrun would start them (spawn.launch_lab)."""
    metrics_path = workdir / f"metrics-{len(list(workdir.iterdir()))}.json"
    return launch_lab(ROOT / "labs" / "lab04_pipeline.py", nproc, args, metrics_path,
                      torchrun=torchrun)


runs = {}
for name in lab.SCHEDULES:
    if labkit.pipeline.schedule_class(name) is None:
        print(f"{name}: not in torch {lab.torch.__version__}")
        continue
    runs[name] = run_lab(2, "--schedule", name, "--microbatches", "4", "--steps", "8",
                         "--check-parity", torchrun=not runs)  # the first, as you would run it
for name, m in runs.items():
    worst = max(m["parity_max_abs_diff"], m["grad_parity_max_abs_diff"],
                m["loss_parity_max_abs_diff"])
    print(f"{name:22s} params {m['parity_max_abs_diff']:.1e}  step-1 grads "
          f"{m['grad_parity_max_abs_diff']:.1e}  losses {m['loss_parity_max_abs_diff']:.1e}")
    assert worst <= 1e-5

# %% [markdown]
# ## The timelines
#
# Every run recorded when each forward / backward ran on each rank (the lab wraps the three
# `PipelineStage` methods every schedule calls, so waits for sends and receives are not
# counted as work). Below, one step per schedule (the step with the median bubble), all on
# the same time axis. The label is the microbatch; the colour is the action.

# %%
fig, axes = plt.subplots(len(runs), 1, figsize=(8, 1.7 * len(runs) + 0.8), sharex=True)
for ax, (name, m) in zip(axes, runs.items()):
    # The lab's events are (kind, stage, microbatch, start, end, cpu time): keep what we draw.
    ranks = [[(kind, mb, start, end) for kind, _, mb, start, end, _ in events]
             for events in m["timeline"]["ranks"]]
    draw_gantt(ax, ranks, name)
axes[-1].set_xlabel("ms since the step's first action", fontsize=10)
gantt_legend(fig, "FBIW")
fig.tight_layout(rect=(0, 0.04, 1, 1))
plt.show()
for m in runs.values():
    assert all(events for events in m["timeline"]["ranks"])

# %% [markdown]
# ## Measured bubble against theory
#
# For each step the lab computes, per rank, `1 - busy / span` (span from the first action on
# any rank to the last) and averages the ranks. It reports three numbers:
#
# - **measured**: wall clock, the median step. It includes everything real: send/recv latency,
#   Python overhead between actions, and on a shared machine, other processes taking the core.
# - **replayed**: the median step's action order per rank, each action lasting the shortest
#   CPU time measured for its kind and stage (interference only adds time), with instant
#   communication. It removes latency and contention but keeps what the formula
#   ignores: stages of unequal cost (stage 0 also embeds, the last stage also normalises and
#   projects to the vocabulary) and a backward that costs about twice a forward.
# - **equal stages**: the same replay with the formula's assumption, every stage equally fast
#   (forward 1, backward 2). What remains is the shape of the schedule alone.

# %%
print(f"{'schedule':22s} {'formula':>8s} {'equal stages':>13s} {'replayed':>9s} {'measured':>9s}")
for name, m in runs.items():
    b = m["bubble"]
    formula = "-" if b["formula"] is None else f"{b['formula']:.3f}"
    print(f"{name:22s} {formula:>8s} {b['replayed_equal_stages']:13.3f} {b['replayed']:9.3f} "
          f"{b['measured']:9.3f}")
for name in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"):
    b = runs[name]["bubble"]
    assert abs(b["replayed_equal_stages"] - b["formula"]) < 1e-9, (name, b)
    assert min(b["replayed"], b["measured"]) >= b["formula"] - 0.03, (name, b)
assert runs["GPipe"]["bubble"]["formula"] == bubble(2, 4)
assert runs["Interleaved1F1B"]["bubble"]["formula"] == bubble(2, 4, v=2)

# %% [markdown]
# How close is it? With equal stages the replay gives the formula exactly (asserted above; the
# test suite asserts the same): the formula is right about the schedule's shape. With the
# measured costs the replay lands above it by this run's stage imbalance: 0.00 to 0.12 above
# the formula between identical runs on a shared 2-core VM. Neither is below the formula: a
# balanced pipeline is the best case. The measured bubble sits well above it here. The reason
# is scale: each action of this tiny
# model takes a few milliseconds, while a gloo send/receive on CPU plus the Python between
# actions costs a sizeable fraction of that, and the two ranks share the machine with
# whatever else is running, so the wall clock can even rank 1F1B above GPipe. On GPUs with
# real layer sizes, actions take tens of milliseconds and the measurement moves toward the
# replay. [Lesson 06](06_performance.ipynb#3-the-pipeline-bubble-where-compute-dominates)
# makes each microbatch about 250 times heavier and measures that: GPipe and 1F1B then land within
# 15% of the formula, and the interleaved schedule below both. The zero-bubble schedules have no simple
# closed form; their papers (Qi et al. 2024, arXiv:2401.10241) claim a near-zero bubble when
# forward, input-gradient and weight-gradient cost the same, which a 4-microbatch CPU run does
# not meet.
#
# ## Memory: 1F1B holds fewer microbatches than GPipe
#
# 1F1B has the same bubble as GPipe but a different order: after `pp - rank` warm-up forwards
# it alternates one forward, one backward, so a rank never holds more than `pp - rank`
# microbatches of activations. GPipe runs all `m` forwards first. The lab counts the bytes
# autograd saves for backward with `torch.autograd.graph.saved_tensors_hooks` (each storage
# once, parameters excluded) and the microbatches in flight from the timeline:

# %%
for name in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
    m = runs[name]
    kib = [b / 1024 for b in m["saved_activation_peak_bytes_per_rank"]]
    print(f"{name:16s} in flight {m['microbatches_in_flight_per_rank']}  "
          f"saved activations {', '.join(f'{k:.0f} KiB' for k in kib)}")
gpipe, ofob = runs["GPipe"], runs["1F1B"]
assert gpipe["microbatches_in_flight_per_rank"] == [4, 4]
assert ofob["microbatches_in_flight_per_rank"] == [2, 1]
g, o = (m["saved_activation_peak_bytes_per_rank"] for m in (gpipe, ofob))
assert o[0] < 0.6 * g[0] and o[1] < 0.35 * g[1]
fig, ax = plt.subplots(figsize=(5, 2.6))
for i, (name, values) in enumerate((("GPipe", g), ("1F1B", o))):
    ax.bar([r + 0.38 * i for r in range(2)], [v / 1024 for v in values], width=0.38, label=name)
ax.set_xticks([0.19, 1.19], ["rank 0", "rank 1"])
ax.set_ylabel("peak saved activations (KiB)")
ax.legend()
plt.show()

# %% [markdown]
# With `m` much larger than `p` (the only way to get a small bubble) this is the difference
# between holding `m` and holding `p` microbatches: the reason 1F1B replaced GPipe in practice.
#
# ## Composing PP with FSDP and TP
#
# `--dp N` runs N pipelines side by side on a `("pp", "dp")` device mesh: rank
# `pp_rank * dp + dp_rank`. "pp" is the outer axis, as in torchtitan, so on a multi-node job
# the stages go across nodes (a cut sends one activation per microbatch, the lightest traffic
# of all) and each dp group, which all-gathers and reduce-scatters its stage's weights, is
# neighbouring ranks inside one node. Each stage is sharded with `fully_shard` over the `dp`
# axis; the schedule holds the gradient reduce-scatter back until the last microbatch
# (`reshard_after_forward=False` keeps the stage's parameters gathered for the whole step,
# otherwise every microbatch would all-gather them again). The test suite runs
# `torchrun --nproc-per-node 4 labs/lab04_pipeline.py --dp 2 --check-parity` and checks it
# against the same single-process reference. Large jobs add tensor parallelism inside each
# stage: a 3-D mesh `("pp", "dp", "tp")` with TP innermost on the fastest links (inside a
# node), PP outermost across nodes, FSDP in between. Lesson 05 builds it, on 8 processes, with
# [lab 05](../labs/lab05_3d.md).
#
# ## When to choose it
#
# - The model does not fit even sharded, or FSDP's per-layer all-gathers do not overlap with
#   compute on your interconnect: PP sends only one activation per microbatch per cut.
# - You can afford many microbatches (a large global batch): the bubble needs `m >> p`.
# - Layers are uniform (transformer blocks) so stages balance; an embedding or a large
#   vocabulary projection on the end stages unbalances them (visible in the replay above).
# - Prefer 1F1B (memory) or Interleaved1F1B (bubble) first; zero-bubble schedules pay off when
#   the weight-gradient work is large enough to fill the gaps.
#
# ## Summary
#
# - PP cuts the model by layers; neighbours exchange activations and gradients point-to-point.
# - Bubble `(p - 1) / (m + p - 1)`, divided by `v` stages per rank when interleaved; measured
#   here and compared: the equal-stage replay gives the formula exactly, the replay with
#   measured costs lands 0.00 to 0.12 above the formula, the wall clock above both (with
#   stages heavy enough, lesson 06's measured bubble lands within 15% of the formula, once
#   the formula is given each stage's measured time).
# - 1F1B holds at most `pp - rank` microbatches, GPipe all `m`: measured in saved bytes.
# - Every schedule trains the same model as one process: parity within 1e-5.
#
# ## Exercises
#
# - **Graded:** GPipe and 1F1B by hand, over send and recv. Fill in `exercises/pipeline.py`, then run
#   `python exercises/grade.py pipeline`: it checks your code against one process, check by check
#   ([the exercises](../exercises/README.md)).
#
# Each exercise below is checked: it has a self-check (a Python block your answer must pass)
# and a worked answer, collapsed, in [the exercise book](../docs/onboarding-exercises.md).
#
# 1. **The bubble, predicted and measured**: 1F1B's bubble and activations in flight, predicted
#    before lab04 measures them
#    ([onboarding exercise 4.1](../docs/onboarding-exercises.md#exercise-41-the-bubble-predicted-and-measured)).
# 2. **Which stages live on which rank**: the stages `Interleaved1F1B` and `ZBVZeroBubble` put
#    on each of 4 ranks
#    ([onboarding exercise 4.2](../docs/onboarding-exercises.md#exercise-42-which-stages-live-on-which-rank)).
# 3. **The activations GPipe and 1F1B hold**: the microbatches each rank holds at once under
#    both schedules, for any pp and m
#    ([onboarding exercise 4.3](../docs/onboarding-exercises.md#exercise-43-the-activations-gpipe-and-1f1b-hold)).
#
# ## If it breaks
#
# - A rank waits forever in a send or receive: the ranks disagree on the schedule or the
#   microbatch count; see [collective timeouts](../runbooks/collective-timeout.md) and
#   [a stuck rank](../runbooks/stuck-rank.md). The lab's `--timeout-s` turns the wait into an
#   error.
# - Out of memory on the first stage under GPipe: switch to 1F1B, see
#   [OOM mitigations](../runbooks/oom-mitigations.md).
# - More runbooks: [the index](../runbooks/index.md). The lab: [lab 04](../labs/lab04_pipeline.md).
