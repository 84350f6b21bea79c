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
# # 05 · 3-D parallelism: pipeline x FSDP x tensor parallel
#
# After this lesson you can:
#
# - say what each axis sends, how often, and therefore where it goes on a cluster: TP inside
#   a node, PP and FSDP across nodes, with the numbers for a 70B model;
# - read the memory per GPU of a 70B plan on 64 and on 512 GPUs from the course's estimator,
#   and say why it fits only with activation checkpointing;
# - build a `("pp", "dp", "tp")` mesh in torchtitan's order (cut into stages, then TP inside
#   each block, then FSDP over dp) with `labs/lab05_3d.py`, and count one step's collectives
#   per axis against the formula;
# - draw one step of all three axes on one timeline;
# - show that three layouts train the same model as one process (parity within 1e-5), and
#   that one checkpoint resumes on three different layouts.
#
# Everything runs on a laptop CPU: 8 gloo processes on 2 cores. On GPUs the same lab uses NCCL.

# %%
import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import matplotlib.pyplot as plt

ROOT = Path(os.environ.get("COURSE_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "labs" / "lab01_ddp.py").exists()))
sys.path.insert(0, str(ROOT / "lessons"))
sys.path.insert(0, str(ROOT / "labs"))

import lab05_3d as lab  # noqa: E402  (the lab is importable: nothing runs at import)
import threed_workers  # noqa: E402  (worker functions live in a module: spawn re-imports them)
from labkit.model import MODEL_PRESETS, flops_per_token  # noqa: E402  (the labs' kit)
from spawn import launch_lab, run_workers  # noqa: E402

# %% [markdown]
# ## Three axes, three kinds of traffic
#
# Each earlier lab split one thing:
#
# | axis | lesson | splits | sends | how often |
# |---|---|---|---|---|
# | tp | 03 | each weight matrix, by columns or rows | an all-reduce of one activation | 4 per block per microbatch (2 forward, 2 backward) |
# | dp (FSDP) | 02 | each weight, into shards | the weights gathered, the gradients reduce-scattered | once per block per step, because under PP the lab keeps them gathered (`reshard_after_forward=False`); lab02's FSDP gathers twice |
# | pp | 04 | the layers, into stages | one activation forward, its gradient back | once per microbatch per cut |
#
# The counts differ by orders of magnitude, and so must the links they run on. Below are the
# bytes one GPU sends per step for Llama-3.1-70B (80 blocks, width 8192) on 64 GPUs laid out
# as pp 4 x dp 2 x tp 8, with 8 microbatches of one 8192-token sequence and bf16
# activations. These are formulas (ring collectives, lesson 00), not measurements.

# %%
def bytes_per_step(cfg, pp, dp, tp, microbatches, act_bytes=2, param_bytes=2, grad_bytes=4):
    """Bytes one rank of the busiest stage sends per step, per axis (ring algorithms)."""
    activation = cfg["micro_batch"] * cfg["seq_len"] * cfg["dim"] * act_bytes
    blocks = cfg["num_layers"] // pp
    stage_params = cfg["num_params"] / pp
    ring = lambda n: (n - 1) / n  # noqa: E731  (the share of a buffer each rank sends)
    return {
        "tp": microbatches * blocks * 4 * 2 * ring(tp) * activation,  # all-reduce: 2 (n-1)/n
        "dp": stage_params / tp * (param_bytes + grad_bytes) * ring(dp),  # gather + scatter
        "pp": 2 * microbatches * activation,  # an interior stage: one send each way per mb
    }


LLAMA_70B = {"num_params": 70.55e9, "num_layers": 80, "dim": 8192, "seq_len": 8192,
             "micro_batch": 1}
traffic = bytes_per_step(LLAMA_70B, pp=4, dp=2, tp=8, microbatches=8)
# Published link speeds (datasheets, not measured here): NVLink on an H100 SXM is 900 GB/s in
# total, 450 GB/s each way; one 400 Gb/s InfiniBand NIC per GPU is 50 GB/s each way.
NVLINK, INFINIBAND = 450e9, 50e9
for axis, sent in traffic.items():
    print(f"{axis}: {sent / 1e9:7.1f} GB per step per GPU | {sent / NVLINK * 1e3:6.0f} ms on "
          f"NVLink | {sent / INFINIBAND * 1e3:6.0f} ms on InfiniBand")
assert traffic["tp"] > 10 * traffic["dp"] and traffic["dp"] > traffic["pp"]

# %% [markdown]
# Compare with the compute of that step. One rank does 1/(pp x tp) of each microbatch's
# FLOPs: 65,536 tokens x 481 GFLOP per token / 32 = 986 TFLOP, about 2.5 s on an H100 at 40%
# of its 989 TFLOP/s bf16 peak (the datasheet figure; 40% is a round, optimistic figure:
# torchtitan's published Llama 3.1 8B run on 8 H100s reaches 34%, as lesson 06 computes).
# TP's ~150 GB costs about 0.33 s on NVLink, a fraction of the compute, but 3 s on InfiniBand,
# more than the compute: **TP stays inside a node**. FSDP's ~6.6 GB per step crosses
# InfiniBand in about 0.13 s and overlaps with compute (lesson 02), and PP's ~2 GB is the
# lightest of all: **PP and DP go across nodes**. That is the order of the mesh, outermost
# first: `("pp", "dp", "tp")`, so that a TP group is 8 consecutive ranks, one node.

# %%
llama_70b = argparse.Namespace(**MODEL_PRESETS["70b"])  # the labs' preset: 70.55B params
flop_per_token = flops_per_token(llama_70b, llama_70b.seq_len)  # the labs' MFU formula
per_rank_flop = 8 * 8192 * flop_per_token / (4 * 8)  # 8 microbatches, 1/(pp x tp) each
compute_s = per_rank_flop / (0.40 * 989e12)
print(f"{flop_per_token / 1e9:.1f} GFLOP per token; per GPU per step {per_rank_flop / 1e12:.0f} "
      f"TFLOP, {compute_s:.1f} s at 40% of the H100's bf16 peak")
assert traffic["tp"] / NVLINK < 0.2 * compute_s < traffic["tp"] / INFINIBAND

# %% [markdown]
# ## Memory per GPU: a 70B plan on 64 and on 512 GPUs
#
# `--plan` prints what the busiest rank holds, from the course's estimator (AdamW with fp32
# master weights: 16 bytes per parameter, divided over dp x tp; the weights FSDP keeps
# gathered; activations of the microbatches in flight), and starts no process group, so it
# runs here. The busiest rank is the first stage's: 20 blocks plus the embedding and output
# (the estimate counts both on every stage), and with 1F1B the most microbatches in flight.
# Two terms do not shrink as dp grows. Under pipelining the lab keeps every block of a stage
# gathered for the whole step, each with an unsharded fp32 gradient
# (`reshard_after_forward=False`, and the pipeline stage holds back FSDP's reshard and
# gradient sync until the last microbatch: `torch/distributed/pipelining/stage.py`). And
# without sequence parallel the norms' activations are whole on every tp rank: only the rest
# of a block's activations is divided by tp (`tests/test_plan_measured.py` checks both terms
# against bytes measured on CPU).

# %%
def plan(nproc, pp, dp, tp, *extra):
    cmd = [sys.executable, str(ROOT / "labs" / "lab05_3d.py"), "--plan", "--model", "70b",
           "--nproc", str(nproc), "--gpu", "H100-80GB", "--pp", str(pp), "--dp", str(dp),
           "--tp", str(tp), "--microbatches", "8", *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout
    items = dict(re.findall(r"^  (\S.*?)\s{2,}([\d.]+) GB", out, re.M))
    return out, {name: float(gb) for name, gb in items.items()}


plans = {"64 GPUs": plan(64, pp=4, dp=2, tp=8), "512 GPUs": plan(512, pp=4, dp=16, tp=8),
         "64 GPUs, recompute": plan(64, 4, 2, 8, "--activation-checkpointing")}
print(plans["64 GPUs"][0])
for name, (_, items) in plans.items():
    state = items["params (fp32)"] + items["grads (fp32)"] + items["AdamW state (2 x fp32)"]
    print(f"{name:18s} weights, grads, AdamW {state:5.2f} GB | gathered stage "
          f"{items['gathered (FSDP)']:5.2f} GB | activations "
          f"{items['activations']:5.2f} GB | total {items['total']:6.2f} GB of 80")
small, big, recompute = (items for _, items in plans.values())
# Eight times the dp degree, an eighth of the state; the gathered stage and the activations
# do not shrink with dp, so more GPUs alone never make this layout fit.
assert abs(small["params (fp32)"] / big["params (fp32)"] - 8) < 0.01
assert small["activations"] == big["activations"] > 0.75 * 80
assert small["gathered (FSDP)"] == big["gathered (FSDP)"]
assert big["total"] > 0.9 * 80 and recompute["total"] < 0.9 * 80

# %% [markdown]
# At 64 GPUs the plan needs 113 GB of an 80 GB H100, and at 512 still 96 GB: dp divides the
# weights, gradients and AdamW state (19 GB, then 2.4 GB), but not the 14.4 GB of the gathered
# stage, nor the 69 GB of activations (1F1B already keeps only `pp` of the 8 microbatches in
# flight, lesson 04). More GPUs are the wrong lever. Activation checkpointing is the right one
# (the lab's `--activation-checkpointing`; runbooks/oom-mitigations.md): each block keeps only
# its input, 69 GB of activations become 14 GB, and the run fits on 64 GPUs (58 GB). Sequence
# parallel, which lab05 does not have, would divide the norms' share by tp as well.

# %% [markdown]
# ## The code: cut, then TP, then FSDP
#
# The lab builds each stage the way torchtitan does: `pipeline_llm()` cuts the model into
# stage modules, then applies its `parallelize_fn` to each, which applies tensor parallel
# first and FSDP last (torchtitan `torchtitan/distributed/pipeline_parallel.py` and
# `models/llama3/parallelize.py`, commit b5bcd76). The order matters:
#
# - **Cut first**: a stage keeps only its layers, on the meta device, so nothing else is ever
#   allocated or sharded.
# - **TP before FSDP**: `parallelize_module` turns each weight into a DTensor sharded over "tp";
#   `fully_shard` then shards that again over "dp" (2-D placements). FSDP's all-gather over dp
#   rebuilds exactly the tp slice that TP's hooks expect. The other way round, TP's plan would
#   meet parameters that FSDP had already turned into dp-sharded DTensors (FSDP2 keeps each
#   parameter as a `Shard(0)` DTensor, with no flat buffer), not the plain weights it splits.
# - **Materialise last**: `to_empty` allocates only the local shard, and every shard is filled
#   with its slice of the same initial weights the single-process reference gets.

# %%
print(inspect.getsource(lab.build_mesh))
print(inspect.getsource(lab.build_stage_module))

# %% [markdown]
# ## One step's collectives, counted per axis
#
# Eight processes, pp 2 x dp 2 x tp 2, the lab's debug model (4 blocks, 2 per stage), 4
# microbatches. Each rank builds the lab's pipeline and records every collective and send it
# issues during one step, by the mesh axis of its group (`threed_workers.AxisRecorder`).
# The formula, per rank and step, with `m` microbatches, `L` blocks on the stage:
#
# - **tp**: all-reduces `m x (4 L + 1)`: 4 per block, plus the embedding's forward sum on the
#   first stage, or on the last the gradient of the output projection's replicated input; and
#   on the last stage `m` all-gathers (the vocabulary-sharded logits made whole for the loss).
# - **dp**: one all-gather and one reduce-scatter per FSDP unit and step: `L + 1` each (the
#   blocks and the stage's root), since under PP the weights stay gathered for the whole step.
# - **pp**: with 2 stages, `m` sends and `m` receives on every rank.
# - **world**: one all-reduce, the gradient norm for clipping.

# %%
LAYOUT = ["--pp", "2", "--dp", "2", "--tp", "2"]
recorded = run_workers(threed_workers.one_recorded_step, 8, LAYOUT, timeout_s=120,
                       startup_s=240)
m, L = 4, 2


def predicted_counts(first, last):
    counts = {("tp", "all_reduce"): m * (4 * L + 1),
              ("dp", "_allgather_base_"): L + 1, ("dp", "_reduce_scatter_base_"): L + 1,
              ("pp", "send"): m, ("pp", "recv_"): m, ("world", "allreduce_"): 1}
    if last:
        counts[("tp", "all_gather_into_tensor")] = m
    return counts


for rank, r in enumerate(recorded):
    c = r["coords"]
    first, last = r["stages"] == [0], r["stages"] == [1]
    by_axis = Counter()
    for (axis, _), n in r["counts"].items():
        by_axis[axis] += n
    print(f"rank {rank} (pp {c['pp']} dp {c['dp']} tp {c['tp']}): "
          + ", ".join(f"{axis} {n}" for axis, n in sorted(by_axis.items()))
          + f" | step {r['step_s'] * 1e3:.0f} ms")
    assert r["counts"] == predicted_counts(first, last), (rank, r["counts"])

# %% [markdown]
# Every rank issued exactly the predicted operations: 51 on a first-stage rank, 55 on a
# last-stage rank, of which 36 and 40 are TP's. TP's scale with `m x L`, while FSDP's scale
# with `L` only and PP's with `m` only. On the 70B layout above (pp 4, so 20 blocks a stage,
# and 8 microbatches) the same formula gives 8 x (4 x 20 + 1) = 648 TP all-reduces per step
# on a first- or last-stage rank (8 x 80 = 640 on an interior one), against 21 all-gathers
# and 21 reduce-scatters for FSDP: hundreds of TP collectives per step, which is why TP needs
# the fastest links and why sequence parallel and asynchronous TP work so hard to hide them.

# %% [markdown]
# ## One step on one timeline
#
# The same step, drawn per rank: forward (blue) and backward (orange) of each microbatch, and
# a mark where each collective was issued, coloured by axis. The ranks left a barrier together
# just before the step, and on one machine they all read the same clock (`time.perf_counter`,
# CLOCK_MONOTONIC on Linux), so their times compare exactly.

# %%
t0 = min(r["start"] for r in recorded)  # every rank read the same monotonic clock
for r in recorded:
    r["actions"] = [(k, s, mb, a - t0, b - t0) for k, s, mb, a, b in r["actions"]]
    r["events"] = [(axis, op, t - t0, size) for axis, op, t, size in r["events"]]
AXIS_STYLE = {"tp": ("black", "|", "tp all-reduce / all-gather"),
              "dp": ("tab:green", "v", "dp all-gather / reduce-scatter"),
              "pp": ("tab:purple", "o", "pp send / receive"),
              "world": ("tab:red", "*", "world all-reduce (grad norm)")}
fig, ax = plt.subplots(figsize=(10, 4.2))
for rank, r in enumerate(recorded):
    for kind, _, mb, start, end in r["actions"]:
        ax.barh(rank, (end - start) * 1e3, left=start * 1e3, height=0.6, edgecolor="black",
                lw=0.4, color="tab:blue" if kind == "F" else "tab:orange")
        ax.text((start + end) / 2 * 1e3, rank, str(mb), ha="center", va="center", fontsize=9,
                color="white", fontweight="bold")
    for axis, (color, marker, _) in AXIS_STYLE.items():
        times = [t * 1e3 for a, _, t, _ in r["events"] if a == axis]
        ax.scatter(times, [rank - 0.42] * len(times), color=color, marker=marker, s=28,
                   zorder=3)
ax.set_yticks(range(8), [f"rank {i}  (pp {r['coords']['pp']} dp {r['coords']['dp']} tp "
                         f"{r['coords']['tp']})" for i, r in enumerate(recorded)], fontsize=10)
ax.invert_yaxis()
ax.set_xlabel("ms since the step began", fontsize=10)
ax.tick_params(axis="x", labelsize=10)
ax.set_title("One 1F1B step on pp 2 x dp 2 x tp 2 (numbers: microbatch)", fontsize=11,
             loc="left")
handles = [plt.Rectangle((0, 0), 1, 1, color="tab:blue"),
           plt.Rectangle((0, 0), 1, 1, color="tab:orange")]
handles += [plt.Line2D([], [], color=c, marker=mk, ls="") for c, mk, _ in AXIS_STYLE.values()]
fig.legend(handles, ["forward", "backward", *[s[2] for s in AXIS_STYLE.values()]],
           loc="lower center", ncol=3, fontsize=10, frameon=False)
fig.tight_layout(rect=(0, 0.14, 1, 1))
plt.show()

# Read off the chart, checked: on every rank FSDP gathers the first block before any forward
# finishes; the last stage starts microbatch 0 only after the first stage finished it (for
# the same dp and tp slot), and the grad-norm all-reduce comes after every backward.
for rank, r in enumerate(recorded):
    first_gather = min(t for a, op, t, _ in r["events"] if a == "dp" and "gather" in op)
    first_forward_end = min(end for kind, _, _, _, end in r["actions"] if kind == "F")
    assert first_gather < first_forward_end, rank
    norm = max(t for a, _, t, _ in r["events"] if a == "world")
    assert norm > max(end for kind, _, _, _, end in r["actions"] if kind == "B"), rank
for rank in range(4):  # pp 0 ranks; rank + 4 holds the next stage at the same (dp, tp)
    f0 = [(s, e) for kind, _, mb, s, e in recorded[rank]["actions"] if kind == "F" and mb == 0]
    f1 = [(s, e) for kind, _, mb, s, e in recorded[rank + 4]["actions"]
          if kind == "F" and mb == 0]
    assert f1[0][0] > f0[0][1], rank

# %% [markdown]
# ## Parity on three layouts, and one checkpoint resumed on three layouts
#
# The lab's `--check-parity` retrains the same global batches in one process and compares
# every parameter after the last step, the first step's gradients and every step's loss. The
# plan, 12 steps in all:
#
# 1. an uninterrupted run on pp 2 x dp 2 x tp 2: the reference timeline of losses;
# 2. the same layout, stopped at step 4 with a DCP checkpoint;
# 3. resumed on pp 1 x dp 2 x tp 4 (no pipeline, TP over 4), stopped at step 8;
# 4. resumed in one process, pp 1 x dp 1 x tp 1, to step 12.
#
# Each resumed leg runs its own parity check too (its reference trains from step 0), so
# every layout is checked against one process, and the chained losses must continue the
# uninterrupted run's. The checkpoint holds each tensor under the whole model's name
# (`layers.3.attention.wq.weight`), with each shard's offsets, so any layout can read the
# slices it needs.
#
# <details><summary>How these runs are launched</summary>
#
# The runs fork their ranks from a server that has already imported torch (`launch_lab` in
# `lessons/spawn.py`), with the environment torchrun gives each rank: the same run as the
# `torchrun` command in `run_lab`'s docstring, and about 20 s less start-up each for 8 ranks
# on a 2-core laptop.
# </details>

# %%
workdir = Path(tempfile.mkdtemp(prefix="lesson05-"))


def run_lab(nproc, *args):
    """torchrun --standalone --nproc-per-node nproc labs/lab05_3d.py ARGS, with the ranks
    forked as torchrun would start them (spawn.launch_lab)."""
    metrics_path = workdir / f"metrics-{len(list(workdir.glob('metrics-*')))}.json"
    return launch_lab(ROOT / "labs" / "lab05_3d.py", nproc, args, metrics_path)


ckpt = workdir / "checkpoints"
common = ["--steps", 12, "--log-every", 1, "--check-parity"]
straight = run_lab(8, *common)
legs = [run_lab(8, *common, "--checkpoint-dir", ckpt, "--stop-at-step", 4),
        run_lab(8, *common, "--checkpoint-dir", ckpt, "--stop-at-step", 8,
                "--pp", 1, "--dp", 2, "--tp", 4),
        run_lab(1, *common, "--checkpoint-dir", ckpt)]

# %%
print("layout        steps   params   step-1 grads  losses")
for m_ in [straight, *legs]:
    grads = m_["grad_parity_max_abs_diff"]
    print(f"{m_['pp_size']} x {m_['dp_size']} x {m_['tp_size']}     {m_['losses'][0][0]:>2}..{m_['losses'][-1][0]:<3}"
          f"  {m_['parity_max_abs_diff']:.1e}  {'(resumed)' if grads is None else f'{grads:.1e}':>12}"
          f"  {m_['loss_parity_max_abs_diff']:.1e}")
    assert m_["parity_max_abs_diff"] <= 1e-5 and m_["loss_parity_max_abs_diff"] <= 1e-5
    assert grads is None or grads <= 1e-5
assert [(m_["pp_size"], m_["dp_size"], m_["tp_size"]) for m_ in legs] == [(2, 2, 2), (1, 2, 4),
                                                                         (1, 1, 1)]
chained = [loss for leg in legs for loss in leg["losses"]]
assert [step for step, _ in chained] == list(range(1, 13))
worst = max(abs(a - b) for (_, a), (_, b) in zip(chained, straight["losses"]))
print(f"chained losses vs the uninterrupted run: max |diff| {worst:.1e} over 12 steps")
assert worst <= 1e-5
saved = sorted(p.name for p in (ckpt / "step_00000008").iterdir())
print("the checkpoint of step 8, written by 8 ranks on 1 x 2 x 4:", saved)

# %%
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.plot(*zip(*straight["losses"]), color="gray", lw=6, alpha=0.35,
        label="uninterrupted, 2 x 2 x 2")
for leg, color in zip(legs, ["tab:blue", "tab:orange", "tab:green"]):
    steps, values = zip(*leg["losses"])
    ax.plot(steps, values, "o-", color=color, ms=5,
            label=f"{leg['pp_size']} x {leg['dp_size']} x {leg['tp_size']}, steps "
                  f"{steps[0]}-{steps[-1]}")
ax.set_xlabel("step", fontsize=10)
ax.set_ylabel("loss", fontsize=10)
ax.tick_params(labelsize=10)
ax.legend(fontsize=10, frameon=False)
ax.set_title("One run, three layouts (pp x dp x tp), one checkpoint format", fontsize=11,
             loc="left")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Choosing a layout
#
# Start from the hardware and the model, in this order:
#
# 1. **tp**: the smallest degree that makes one block's weights and activations fit, and never
#    more than the GPUs of one node (8 on most servers). Every doubling halves the matmuls and
#    adds no new collectives, but each one is a smaller share of a bigger all-reduce.
# 2. **pp**: only if the model still does not fit with FSDP over the remaining GPUs, or FSDP's
#    per-step traffic does not overlap on your inter-node links. Then pick `m >= 4 pp`
#    microbatches so the bubble `(pp - 1) / (m + pp - 1)` stays small (lesson 04).
# 3. **dp**: everything left. It scales the batch, and with FSDP it divides the optimizer
#    state (the 64 -> 512 GPU plan above), but not the activations: those take activation
#    checkpointing or sequence parallel.
#
# `--plan` answers the memory question for any layout before you ask the cluster for GPUs.
#
# ## Summary
#
# - TP sends hundreds of activation-sized all-reduces per step (648 on a first-stage rank of
#   the 70B layout), FSDP one gather and one reduce-scatter per block, PP one activation per
#   microbatch per cut: TP in a node, PP and DP across.
# - The lab builds the 3-D mesh outermost first, `("pp", "dp", "tp")`, and each stage in
#   torchtitan's order: cut, TP, FSDP, materialise.
# - Counted on 8 ranks, one step issued exactly the collectives the formula predicts.
# - Three layouts and one process train the same model (parity within 1e-5), and one DCP
#   checkpoint moves between them.
#
# ## Exercises
#
# Each exercise below is checked: it has a self-check (a Python block your answer must pass)
# and a worked answer, collapsed, in [the exercise book](../docs/onboarding-exercises.md).
#
# 1. **Count a step's collectives on every stage**: every collective each rank issues in one
#    step of 4 stages, checked against a recorded step
#    ([onboarding exercise 5.1](../docs/onboarding-exercises.md#exercise-51-count-a-steps-collectives-on-every-stage)).
# 2. **The smallest cluster for a 70B run**: the smallest `--nproc` at which lab05's `--plan`
#    fits 70B on H100s, and the verdict without recompute
#    ([onboarding exercise 5.2](../docs/onboarding-exercises.md#exercise-52-the-smallest-cluster-for-a-70b-run)).
#
# ## If it breaks
#
# - A layout that does not multiply to the world size, or a `--tp` that does not divide the
#   heads: the lab says so in one line and exits 2 before any process starts.
# - A rank waits forever: every axis's groups carry `--timeout-s` (`init_mesh()`); see
#   [collective timeouts](../runbooks/collective-timeout.md) and
#   [a stuck rank](../runbooks/stuck-rank.md).
# - Out of memory on the first stage: [OOM mitigations](../runbooks/oom-mitigations.md).
# - The lab: [lab 05](../labs/lab05_3d.md).
