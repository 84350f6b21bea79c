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
# # 02 · FSDP2: sharding you can see, memory that matches the math
#
# After this lesson you can:
#
# - compute what each rank holds under DDP, ZeRO-1, ZeRO-2 and ZeRO-3/FSDP, and name what that
#   figure leaves out;
# - shard a layer by hand (all-gather before use, reduce-scatter the gradients) and show that
#   `fully_shard` does exactly that;
# - build a model on the meta device, shard it with `fully_shard`, and fill each rank's shards;
# - run `labs/lab02_fsdp.py` and prove, to 1e-5, that it trains the model one process would;
# - port FSDP1 code to FSDP2 and spot the wrong advice that circulates about it.
#
# Everything runs on a laptop CPU over gloo. On GPUs the same code uses NCCL.

# %%
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

ROOT = Path(os.environ.get("COURSE_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "labs" / "lab01_ddp.py").exists()))
sys.path.insert(0, str(ROOT / "lessons"))
sys.path.insert(0, str(ROOT / "labs"))

import fsdp_workers  # noqa: E402  (worker functions live in a module: spawn re-imports them)
import lab02_fsdp as lab  # noqa: E402  (the lab is importable: nothing runs at import)
import memory_estimator as est  # noqa: E402
from spawn import run_script, run_workers  # noqa: E402

# %% [markdown]
# ## Why
#
# DDP keeps a full replica on every rank: parameters, gradients and optimizer state. In fp32
# with AdamW (two states per parameter) that is 4 + 4 + 8 = **16 bytes per parameter**, on every
# rank, however many ranks you add. The estimator in `labs/memory_estimator.py` does this
# arithmetic for the four ZeRO stages:

# %%
print(est.table(7_000_000_000, 8))
ddp_7b = est.estimate_per_rank(7e9, 8, "ddp").total_bytes
fsdp_7b = est.estimate_per_rank(7e9, 8, "fsdp").total_bytes
assert ddp_7b == 112e9 and fsdp_7b == 14e9   # 7B does not fit an 80 GB GPU under DDP

# %% [markdown]
# A 7B model needs 112 GB per rank under DDP: it does not fit an 80 GB GPU before a single
# activation is stored. Sharded over 8 ranks (ZeRO-3, which FSDP implements) it needs 14 GB.
#
# That is the whole idea. Below, FSDP is built by hand, then with `fully_shard`, and measured;
# then the lesson comes back to [what sharding leaves](#what-sharding-leaves-activations-and-the-gathered-unit):
# activations and the gathered unit.
#
# The words the rest of the lesson uses:
#
# - **ZeRO-1** shards the optimizer state; parameters and gradients stay whole on every rank.
# - **ZeRO-2** shards the gradients too.
# - **ZeRO-3** shards the parameters too: this is what FSDP does.
# - A **unit** is what one `fully_shard` call groups (here, one transformer block): FSDP
#   all-gathers its parameters together before use and frees them together after.
# - The **root** is the model itself, wrapped last by `fully_shard(model)`: it holds the rest
#   (embeddings, final norm, output) and stays gathered from forward to the end of backward.

# %% [markdown]
# ## From scratch: shard, all-gather, reduce-scatter
#
# FSDP is three moves. Each rank keeps only a slice (rows, dim 0) of every weight. Before the
# weight is used, an **all-gather** rebuilds it; it is freed right after. After backward, each
# rank has a full-size gradient computed on its own data; a **reduce-scatter** sums those
# gradients across ranks and hands each rank only the rows it owns. The optimizer then updates
# only the local shard. Below, one linear layer is trained that way by hand on 2 processes,
# then with `fully_shard`, then in one process on the whole global batch. The worker below
# (`lessons/fsdp_workers.py`) does all three; part (1) is FSDP by hand.

# %%
print(inspect.getsource(fsdp_workers.shard_by_hand_vs_fully_shard))

# %%
results = run_workers(fsdp_workers.shard_by_hand_vs_fully_shard, 2, timeout_s=120)
for rank, r in enumerate(results):
    print(f"rank {rank}: holds {r['shard_shape']} of [6, 4]; fully_shard holds "
          f"{r['fsdp_shard_shape']} {r['placements']}; |by hand - FSDP| {r['by_hand_vs_fsdp']:.1e}, "
          f"|by hand - one process| {r['by_hand_vs_single']:.1e}")
assert all(r["shard_shape"] == r["fsdp_shard_shape"] == [3, 4] for r in results)
assert all(r["by_hand_vs_fsdp"] <= 1e-6 and r["by_hand_vs_single"] <= 1e-6 for r in results)

# %% [markdown]
# Same numbers to float rounding: `fully_shard` is those three collectives plus scheduling.
#
# ### One FSDP step, unit by unit
#
# In one step, each block is all-gathered twice (before its forward, and one block ahead
# before its backward), freed after each use, and reduce-scattered as soon as its backward
# ends; the root is gathered once and kept whole. The picture shows it for the lab's model
# (two blocks plus the root) on 2 gloo ranks.
#
# The bars come from `torch.profiler`: FSDP2 labels every phase it runs with `record_function`
# (`FSDP::all_gather (layers.0)`, ...). `fsdp_workers.fsdp_step_trace` records one step, and
# `fsdp_workers.step_phases` turns the labels into bars:

# %%
trace = run_workers(fsdp_workers.fsdp_step_trace, 2, timeout_s=180)[0]
bars = fsdp_workers.step_phases(trace["events"])  # [(unit, phase, start ms, end ms), ...]
colors = {"all-gather": "tab:blue", "all-gather (prefetch)": "tab:cyan", "forward": "tab:green",
          "backward": "tab:orange", "free": "0.4", "reduce-scatter": "tab:red"}
units = ["root", "layers.0", "layers.1"]
fig, ax = plt.subplots(figsize=(8, 2.8))
for unit, phase, start, end in bars:
    ax.barh(units.index(unit), max(end - start, 0.15), left=start, color=colors[phase],
            edgecolor="black", lw=0.3, height=0.7)
ax.set_yticks(range(len(units)), units, fontsize=10)
ax.invert_yaxis()
ax.set_xlabel("ms since the step's first FSDP action (rank 0)", fontsize=10)
ax.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], list(colors),
          ncol=3, fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
ax.set_title("One FSDP step on 2 CPU ranks (gloo), from torch.profiler", fontsize=11)
fig.tight_layout()
plt.show()
kinds = {(unit, phase) for unit, phase, _, _ in bars}
assert {("layers.0", "all-gather"), ("layers.1", "all-gather (prefetch)"),
        ("layers.0", "all-gather (prefetch)"), ("layers.0", "reduce-scatter"),
        ("root", "reduce-scatter")} <= kinds
gathers = {u: sum(1 for unit, phase, _, _ in bars if unit == u and phase.startswith("all-gather"))
           for u in units}
assert gathers == {"root": 1, "layers.0": 2, "layers.1": 2}
frees = {u: sum(1 for unit, phase, _, _ in bars if unit == u and phase == "free") for u in units}
assert frees == {"root": 0, "layers.0": 2, "layers.1": 2}  # after forward and after backward

# %% [markdown]
# Read it top to bottom. Each block is all-gathered before its forward and freed right after
# (the dark sliver); in backward it is all-gathered again, and FSDP issues that all-gather one
# block *ahead* (`backward_prefetch`, light blue): layers.1's gather is posted from the root's
# backward (the output projection runs first), and layers.0's while layers.1 is still to
# compute its backward. Each block's gradient is reduce-scattered as soon as its backward is
# done. The root is gathered once: FSDP keeps it whole from forward to backward, because
# backward starts with the output projection.
#
# This trace shows order, not overlap. FSDP2 issues its all-gathers with `async_op=False` and
# relies on a separate CUDA stream to run them beside compute, so on a CPU the training thread
# waits for each one and the bars sit side by side (lesson 06 measures this, and what async
# all-gathers change). The trace also shows one gloo detail: the reduce-scatter is carried out
# as an all-reduce (`gloo:all_reduce` inside each `post_backward_reduce`).
#
# <details><summary>Where the streams are in torch's source</summary>
#
# `all_gather_stream` and `reduce_scatter_stream` in
# `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py` (torch 2.13). GPU only, not
# measured here.
# </details>
#
# ### FSDP's bytes, counted
#
# `CommCounter` (`labs/labkit/probes.py`) is the lab kit's counter of collectives: it records
# each one the step runs and the bytes this rank sends for it, with the ring factors of lesson
# 00. The traced step above ran under it. Against DDP's all-reduce of the same gradients:

# %%
n, P, R = 2, trace["param_bytes"], trace["root_param_bytes"]
gathered = trace["wire_bytes"]["c10d._allgather_base_"]
scattered = trace["wire_bytes"]["c10d._reduce_scatter_base_"]
ddp_bytes = trace["ddp_wire_bytes"]
print(f"all-gathers {gathered:,} B + reduce-scatter {scattered:,} B = {gathered + scattered:,} B "
      f"sent per rank; DDP's all-reduce {ddp_bytes:,.0f} B; ratio {(gathered + scattered) / ddp_bytes:.3f}")
# Blocks are gathered twice (forward, backward), the root once; every gradient scattered once.
assert gathered == (n - 1) / n * (2 * (P - R) + R) and scattered == (n - 1) / n * P
assert abs((gathered + scattered) / ddp_bytes - (1.5 - R / (2 * P))) < 1e-9

# %% [markdown]
# So FSDP sends 1.5x DDP's bytes, less half the root's share (the root is gathered once): 1.47x
# here. The counts are those of a ring (NCCL); gloo's all-reduce-based reduce-scatter sends
# more on CPU. Traded for 1/N of the memory.
#
# ## With PyTorch: fully_shard
#
# The lab builds the model on the **meta device** (shapes, no memory), shards it, and only
# then allocates: each rank allocates its shards and nothing else. Each transformer block is
# one unit (an all-gather before its forward, another before its backward, and one
# reduce-scatter, as the trace above showed); the root call groups the rest:

# %%
print(inspect.getsource(lab.apply_fsdp))
print(inspect.getsource(lab.build_fsdp_model))

# %% [markdown]
# In order:
#
# 1. Build the model on the meta device: shapes, no memory.
# 2. `fully_shard` each block, then the root (`apply_fsdp`): every parameter becomes a DTensor
#    shard, still on meta.
# 3. `model.to_empty(...)`: each rank allocates its shards and nothing else, uninitialized.
# 4. Fill the values: `init_sharded_weights` (`labs/labkit/model.py`) computes each full
#    parameter once, the values one process would draw, and copies this rank's slice.
#
# Step 4 costs one full parameter of transient memory and no communication; the alternatives
# (scatter from rank 0 with `distribute_tensor`, or load the shards from a DCP checkpoint) are
# in its docstring.
#
# ### DeviceMesh: the ranks, arranged by axis
#
# `fully_shard` takes a `mesh`: a `DeviceMesh`, the ranks laid out in a grid with one process
# group per axis (lesson 00's sub-groups, made for you). A 1-D mesh of 4 ranks is one group of
# all 4, and FSDP shards over it. A 2 x 2 mesh with axes `("dp_replicate", "dp_shard")` has
# rows and columns: FSDP shards within a row and replicates across rows (HSDP, hybrid sharded data
# parallel, below); lesson
# 03 puts tensor parallelism on the second axis instead. Rank r sits at row r // 2,
# column r % 2:

# %%
meshes = run_workers(fsdp_workers.mesh_axes, 4, timeout_s=120)
for r, m in enumerate(meshes):
    print(f"rank {r}: 1-D 'dp' group {m['dp']} | 2 x 2 at {m['coordinate']}: "
          f"'dp_shard' group {m['dp_shard']}, 'dp_replicate' group {m['dp_replicate']}")
for r, m in enumerate(meshes):
    assert m["dp"] == [0, 1, 2, 3] and tuple(m["coordinate"]) == (r // 2, r % 2)
    assert m["dp_shard"] == [2 * (r // 2), 2 * (r // 2) + 1]      # its row
    assert m["dp_replicate"] == [r % 2, r % 2 + 2]                # its column

# %% [markdown]
# `init_device_mesh` creates each axis's groups with `new_group`, which in torch 2.13 does not
# take the default group's timeout (30 minutes on gloo instead). The labs build their mesh
# with the kit's `init_mesh()`, which passes it: see the
# [collective-timeout runbook](../runbooks/collective-timeout.md).

# %% [markdown]
# ### Measured: bytes each rank holds
#
# `lessons/fsdp_workers.py` builds the model with the lab's own functions for each strategy,
# runs one optimizer step, and sums the storage behind the tensors each rank holds
# (`measure_state_bytes` in the lab kit's probes, `labs/labkit/probes.py`). World sizes 1, 2, 4:

# %%
measured = {n: run_workers(fsdp_workers.measure_strategies, n, ("ddp", "zero3"), timeout_s=240)
            for n in (1, 2)}
measured[4] = run_workers(fsdp_workers.measure_strategies, 4, timeout_s=240)  # + zero1, fsdp_no_reshard, hsdp
shapes = measured[1][0]["param_shapes"]
num_params = sum(torch.Size(s).numel() for s in shapes)


def total(per_rank):
    return max(r["params"] + r["grads"] + r["optimizer"] for r in per_rank)


rows = {}
for n, ranks in measured.items():
    for strategy in ("ddp", "zero3"):
        got = total([r[strategy] for r in ranks])
        predicted = est.estimate_per_rank(None, n, strategy, shapes=shapes).total_bytes
        rows[(strategy, n)] = got
        print(f"{strategy:5s} world {n}: measured {got:9,d} B per rank, estimator {predicted:9,d} B "
              f"({got / predicted - 1:+.2%})")
        assert abs(got / predicted - 1) <= 0.05
    ratio = rows[("zero3", n)] / (rows[("ddp", n)] / n)
    print(f"        FSDP / (DDP / {n}) = {ratio:.4f}")
    assert abs(ratio - 1) <= 0.05

# %% [markdown]
# FSDP's per-rank state is DDP's divided by the world size, and the estimator is within 5%
# of what the ranks hold (the small excess is AdamW's `step` counters, one 4-byte scalar per
# parameter tensor). No padding shows here because every dim 0 of this model divides by 1, 2
# and 4. When it does not, FSDP2 pads each shard to `ceil(dim0 / N)` rows, so every rank
# allocates the largest shard; pass `shapes=` to the estimator to include that:

# %%
odd = [(50257, 4096), (3, 4096)]   # a GPT-2-sized vocabulary, and a tensor smaller than N
padded = est.estimate_per_rank(None, 64, "zero3", shapes=odd).params_bytes
even = est.estimate_per_rank(sum(a * b for a, b in odd), 64, "zero3").params_bytes
print(f"params per rank over 64 ranks: {padded:,d} B with padding, {even:,d} B if split evenly "
      f"(+{padded / even - 1:.2%})")
assert padded > even

# %%
sizes = sorted(measured)
fig, ax = plt.subplots(figsize=(6, 3.5))
for strategy, label, marker in [("ddp", "DDP", "o"), ("zero3", "FSDP (fully_shard)", "s")]:
    ax.plot(sizes, [rows[(strategy, n)] / 1e6 for n in sizes], marker=marker, label=f"{label}, measured")
    ax.plot(sizes, [est.estimate_per_rank(None, n, strategy, shapes=shapes).total_bytes / 1e6
                    for n in sizes], "--", color="gray")
ax.plot([], [], "--", color="gray", label="estimator")
ax.set(xlabel="world size", ylabel="MB per rank (params + grads + AdamW)", xticks=sizes,
       title=f"Persistent state per rank, {num_params:,} params")
ax.legend()
plt.show()

# %% [markdown]
# ### ZeRO stages side by side (world size 4)
#
# PyTorch has a native tool for stages 1 and 3: `ZeroRedundancyOptimizer` (stage 1: optimizer
# state sharded) and `fully_shard` (stage 3). Two different things get called "ZeRO-2", so
# this page names them apart:
#
# - **`zero2`** in the estimator is the classic ZeRO-2 (DeepSpeed's stage 2): gradients and
#   optimizer state sharded, a full copy of the parameters on every rank at all times.
# - **`fsdp_no_reshard`**, measured here, is `fully_shard(..., reshard_after_forward=False)`:
#   between steps everything is sharded like stage 3, but each block's gathered parameters stay
#   from its forward until its backward, so the peak during the step holds full parameters.
#
# The last column is the bytes of full-size parameters alive between forward and backward:

# %%
ws4 = measured[4]
print(f"{'strategy':9s}{'params':>10s}{'grads':>10s}{'optimizer':>11s}{'full params in bwd':>20s}")
for name in fsdp_workers.STRATEGY_ARGS:
    r = ws4[0][name]
    print(f"{name:9s}{r['params']:10,d}{r['grads']:10,d}{max(x[name]['optimizer'] for x in ws4):11,d}"
          f"{r['unsharded_after_forward']:20,d}")
full_bytes = 4 * num_params
assert ws4[0]["zero1"]["params"] == full_bytes and ws4[0]["zero1"]["grads"] == full_bytes
assert max(x["zero1"]["optimizer"] for x in ws4) < 0.3 * ws4[0]["ddp"]["optimizer"]
assert ws4[0]["fsdp_no_reshard"]["params"] == ws4[0]["zero3"]["params"] == full_bytes // 4
assert ws4[0]["fsdp_no_reshard"]["unsharded_after_forward"] == full_bytes
# The estimator's "zero2" is the classic ZeRO-2: full parameters on every rank, all the time.
assert est.estimate_per_rank(None, 4, "zero2", shapes=shapes).params_bytes == full_bytes
assert ws4[0]["zero3"]["unsharded_after_forward"] < 0.1 * full_bytes   # only the root's params
print("HSDP layout of layers.0.attention.wq.weight:", ws4[0]["hsdp"]["layout"])

# %% [markdown]
# ZeRO-1 splits whole tensors between ranks (greedily, by size), so its shares are uneven; the
# estimator's even split is the ideal. `fsdp_no_reshard` and ZeRO-3 hold the same state between
# steps; they differ in what is alive during the step. Under stage 3 only the root's
# parameters (embeddings, final norm, output: `fully_shard` keeps the root gathered because
# backward starts with it) stay gathered after forward.
#
# ### What sharding leaves: activations and the gathered unit
#
# Sharding divides the state by the number of ranks. Two things it does not divide decide
# whether a large model fits.
#
# Take a 70B model, AdamW, 64 ranks. The total is 16 B x 70e9 = 1120 GB; sharded,
# 1120 / 64 = **17.5 GB** per rank (decimal; 16.3 GiB).
#
# <details><summary>The "17.6 GB" you may have seen</summary>
#
# A widely copied worked example gives 17.6 GB per rank for the same model. It comes from
# adding per-item figures that were rounded first; the exact sum is 17.5 GB.
# </details>

# %%
e70 = est.estimate_per_rank(70e9, 64, "zero3")
print(f"70B, AdamW, 64 ranks: params {e70.params_bytes / 1e9:.3f} GB + grads "
      f"{e70.grads_bytes / 1e9:.3f} GB + optimizer {e70.optimizer_bytes / 1e9:.2f} GB "
      f"= {e70.total_bytes / 1e9:.2f} GB per rank ({e70.total_bytes / 2**30:.2f} GiB)")
assert est.estimate_per_rank(70e9, 64, "ddp").total_bytes == 1120e9
assert e70.total_bytes == 17.5e9

# %% [markdown]
# That figure is a floor, not a peak: the estimator's table at the top of the lesson listed
# what it leaves out. The biggest by far is the first: **activations**. FSDP shards the state, not the work, so
# every rank still keeps its own micro-batch's activations for backward. Lesson 03 counts them
# with Korthikanti et al.'s formula (arXiv:2205.05198, Table 2): per layer s b h (34 + 5 a s / h)
# bytes with 16-bit activations and no recomputation. For Llama-2-70B (80 layers, h = 8192,
# a = 64) at sequence 4096 and micro-batch 1:

# %%
s, b, h, a, num_layers = 4096, 1, 8192, 64, 80
activations_70b = num_layers * s * b * h * (34 + 5 * a * s / h)
print(f"activations: {activations_70b / 2**30:.0f} GiB per rank, against "
      f"{e70.total_bytes / 2**30:.1f} GiB of sharded state")
assert 480 < activations_70b / 2**30 < 490  # ~485 GiB: about 30x the state the table counts
assert activations_70b > 25 * e70.total_bytes
# FlashAttention (SDPA's fused kernels) stores no s x s scores: drop the 5 a s / h term.
activations_70b_flash = num_layers * s * b * h * 34
print(f"without stored attention scores: {activations_70b_flash / 2**30:.0f} GiB per rank")
assert 80 < activations_70b_flash / 2**30 < 90 and activations_70b_flash > 5 * e70.total_bytes

# %% [markdown]
# The 5 a s / h term is the attention scores, softmax and dropout mask, s x s per head: 160 of
# the 194 here. FlashAttention (what `scaled_dot_product_attention` runs on a GPU) does not
# store them and recomputes them in backward, which leaves about 85 GiB, still five times the
# state. The 34 assumes standard multi-head attention and a 4h GELU MLP with dropout; Llama's
# grouped-query attention and SwiGLU move it by a few units, not the conclusion.
#
# That is why 70B training also needs activation checkpointing (recompute instead of store),
# tensor or sequence parallelism (lesson 03) or pipeline stages (lesson 04).
#
# The next term is the *transient unsharded unit*: a unit (usually one transformer block) must
# be whole while it computes.
# One Llama-2-70B block (dim 8192, MLP hidden 28672, 8 KV heads of 128) holds about 0.86B
# parameters, so 1.6 GiB in bf16, and about twice that while the next block is prefetched:

# %%
dim, hidden, kv_dim = 8192, 28672, 8 * 128
block_params = 2 * dim * dim + 2 * dim * kv_dim + 3 * dim * hidden + 2 * dim
print(f"one block: {block_params / 1e9:.3f}B params = {2 * block_params / 2**30:.2f} GiB in bf16")
assert 0.85e9 < block_params < 0.86e9 and 1.55 < 2 * block_params / 2**30 < 1.65

# %% [markdown]
# ## Run the lab
#
# The lab trains with FSDP on 4 processes, checks every parameter against a single-process
# run on the same global batches, and writes its metrics:

# %%
out_dir = Path(tempfile.mkdtemp())
# torchrun --standalone --nproc-per-node 4 labs/lab02_fsdp.py --steps 20 --check-parity \
#     --metrics-out OUT/fsdp4.json
print(run_script(ROOT / "labs" / "lab02_fsdp.py", 4, ["--steps", 20, "--check-parity",
                 "--metrics-out", out_dir / "fsdp4.json"], timeout_s=300))
run4 = json.loads((out_dir / "fsdp4.json").read_text())
assert run4["parity_max_abs_diff"] <= 1e-5
print("layers.0.attention.wq.weight:", run4["layout"]["layers.0.attention.wq.weight"])

# %%
steps, losses = zip(*run4["losses"])
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(steps, losses, label="FSDP, 4 ranks")
ax.plot(steps, run4["reference_losses"], "--", label="one process, same batches")
ax.set(xlabel="step", ylabel="loss",
       title=f"max |param diff| = {run4['parity_max_abs_diff']:.1e}")
ax.legend()
plt.show()
assert losses[-1] < 0.7 * losses[0]

# %% [markdown]
# Other flags worth a run (all covered by `tests/test_lab02_fsdp.py`): `--hsdp 2` (2 replicas x
# 2 shards), `--reshard-after-forward false`, `--grad-accum 2` (uses
# `set_requires_gradient_sync(False)`), `--mixed-precision bf16`, `--activation-checkpointing`,
# `--cpu-offload`, `--compile`, and `--checkpoint-dir` with `--stop-at-step` then `--resume` at
# a different world size: DCP reshards the checkpoint on load.
#
# ### What each flag costs, measured
#
# Each flag trades one cost for another: bytes on the wire, activations kept for backward, or
# time. One row per flag, 2 ranks, the lab's model (`fsdp_workers.flag_matrix_row`): the bytes
# each rank holds after a step, the bytes it sends per step, the activations autograd keeps for
# backward, the dtypes inside forward (of `layers.0.feed_forward.w1`'s weight and output), and
# the time of the first step and the median of five more.
#
# Two entries measure nothing meaningful on a CPU. The `--cpu-offload` row: the state already
# lives in host memory, so there is nothing to offload and no copy to a GPU to time. And
# `--compile`'s step time: on a model this small, Python overhead and gloo dominate the step,
# so faster kernels cannot show; only its first-step compile cost means something here.

# %%
rows = {label: run_workers(fsdp_workers.flag_matrix_row, 2, label, timeout_s=300)[0]
        for label in fsdp_workers.FLAG_ROWS}
print(f"{'flags':34s}{'state B':>9s}{'all-gather B':>13s}{'red.-scatter B':>15s}"
      f"{'saved act. B':>13s}{'weight / act.':>17s}{'1st step':>10s}{'step':>8s}")
for label, r in rows.items():
    state = sum(r["state"].values())
    print(f"{label:34s}{state:9,d}{r['wire_bytes']['c10d._allgather_base_']:13,d}"
          f"{r['wire_bytes']['c10d._reduce_scatter_base_']:15,d}"
          f"{r['saved_activation_bytes']:13,d}"
          f"{r['dtypes']['weight'] + ' / ' + r['dtypes']['activation']:>17s}"
          f"{r['first_step_s'] * 1e3:8.0f} ms{r['step_s'] * 1e3:6.1f} ms")
base = rows["fp32 (default)"]
gather = {label: r["wire_bytes"]["c10d._allgather_base_"] for label, r in rows.items()}
assert all(r["state"] == base["state"] for r in rows.values())  # sharded state: always fp32
assert gather["--mixed-precision bf16"] * 2 == gather["fp32 (default)"] == gather["--amp bf16 --mixed-precision fp32"]
assert all(r["wire_bytes"]["c10d._reduce_scatter_base_"] == base["wire_bytes"]["c10d._reduce_scatter_base_"]
           for r in rows.values())  # reduce_dtype fp32: gradients travel in fp32 in every row
assert rows["--amp bf16 --mixed-precision fp32"]["dtypes"] == {"weight": "float32", "activation": "bfloat16"}
assert rows["--mixed-precision bf16"]["dtypes"] == {"weight": "bfloat16", "activation": "bfloat16"}
assert rows["--activation-checkpointing"]["saved_activation_bytes"] < base["saved_activation_bytes"] / 5
assert rows["--compile"]["first_step_s"] > 5 * rows["--compile"]["step_s"]

# %% [markdown]
# What the table says, row by row:
#
# - **`--amp bf16 --mixed-precision fp32`** is autocast alone (`--mixed-precision fp32`
#   because the policy's default, `auto`, follows `--amp`), as in lab01: the weights stay fp32 in forward and each
#   matmul casts its inputs to bf16, so the *activations* are bf16 (fewer saved bytes), while
#   FSDP still all-gathers fp32 weights: no fewer bytes on the wire.
# - **`--mixed-precision bf16`** is FSDP's own `MixedPrecisionPolicy(param_dtype=bfloat16,
#   reduce_dtype=float32)`: FSDP casts each shard to bf16 *before* the all-gather, so the
#   gathers carry half the bytes and the block computes in bf16; gradients are still
#   reduce-scattered in fp32, and the sharded parameters and AdamW state stay fp32. It needs no
#   autocast: the parameters themselves are bf16 inside forward and backward. On a GPU this is
#   the lab's default (`--mixed-precision auto` follows `--amp`: bf16 where the GPU has it,
#   fp16 with a GradScaler where it does not); on CPU the default stays fp32, for parity.
# - **`--activation-checkpointing`** keeps only each block's input and recomputes the rest in
#   backward: it saves less than a fifth of the default's activation bytes (asserted), for one
#   extra forward of each block. The parameters are already gathered for backward when the
#   recompute runs, so no bytes are added.
# - **`--cpu-offload`** keeps the sharded state and the optimizer step on the CPU and copies
#   each unit to the GPU for its all-gather. On this CPU its row can only repeat the
#   default's, and says nothing about its GPU cost.
# - **`--compile`** (inductor, per block) pays its compile in the first step: the first step
#   takes more than 5 times the steady one (asserted). It changes neither bytes nor saved
#   activations; lesson 06 measures its speed where compute dominates.
#
# Every row holds the same fp32 state, and reduce-scatters the same fp32 gradient bytes
# (asserted). The other step times are printed, not asserted.
#
# <details><summary>The figures of the run that built this page</summary>
#
# Activation checkpointing cut the saved bytes by about 9x. The step times came from a 2-core
# CPU machine, where Python overhead and gloo dominate a model this small; there, `--compile`'s
# steady step barely moved.
# </details>
#
# **HSDP bytes per mesh axis.** With `--hsdp 2` on 4 ranks, the all-gathers and
# reduce-scatters stay inside each shard group (the fast, intra-node axis); only an all-reduce
# of the gradient *shards* crosses the replicate axis:

# %%
hsdp = run_workers(fsdp_workers.flag_matrix_row, 4, "--hsdp 2", timeout_s=300)[0]
for key, sent in sorted(hsdp["wire_bytes_by_group"].items()):
    print(f"{key:40s} {sent:9,d} B per rank per step")
shard_bytes = hsdp["state"]["grads"]  # the gradient shard this rank owns
by_axis = hsdp["wire_bytes_by_group"]
assert by_axis["dp_shard c10d._allgather_base_"] == gather["fp32 (default)"]
assert by_axis["dp_shard c10d._reduce_scatter_base_"] == base["wire_bytes"]["c10d._reduce_scatter_base_"]
assert by_axis["dp_replicate c10d.allreduce_"] == 2 * (2 - 1) / 2 * shard_bytes
assert not any(key.startswith("dp_replicate") and "gather" in key for key in by_axis)

# %% [markdown]
# Each rank sends the same all-gather and reduce-scatter bytes as plain FSDP over 2 ranks, plus
# an all-reduce of its 1/2 shard across the 2 replicas: 2 (R-1)/R x shard bytes, for R = 2
# replicas. Put the replicate axis across nodes and only that all-reduce crosses them.
#
# ## FSDP1 to FSDP2
#
# FSDP2 replaces FSDP1's wrapper class with one call per module. The diff below ports a typical
# FSDP1 script, and the table after it maps every FSDP1 option to FSDP2. FSDP1 itself needs an
# accelerator, so its side runs only on GPUs; the cell shows its refusal on this CPU.
#
# <details><summary>Why FSDP1 is not run here</summary>
#
# FSDP1's constructor asks for an accelerator. Passing `device_id=torch.device("cpu")` instead
# crashed the process with SIGSEGV (torch 2.13). So FSDP1's side of the table is GPU only, and
# not executed in CI.
# </details>

# %%
fsdp1 = run_workers(fsdp_workers.fsdp1_refuses_cpu, 2, timeout_s=120)[0]
print("FullyShardedDataParallel(model) on CPU:", fsdp1)
assert fsdp1 == "FSDP needs a non-CPU accelerator device, but no accelerator device is detected."

# %% [markdown]
# The migration itself, as a diff: `lessons/fsdp1_train.py` is an FSDP1 script of the usual
# shape (an auto-wrap policy, `ShardingStrategy.FULL_SHARD`, `MixedPrecision`, a full state dict
# gathered on rank 0), and `lessons/fsdp2_train.py` is its FSDP2 port:

# %%
import difflib  # noqa: E402

fsdp1_path, fsdp2_path = (ROOT / "lessons" / n for n in ("fsdp1_train.py", "fsdp2_train.py"))
print("\n".join(difflib.unified_diff(fsdp1_path.read_text().splitlines(),
                                     fsdp2_path.read_text().splitlines(),
                                     "fsdp1_train.py", "fsdp2_train.py", lineterm="", n=1)))

# %% [markdown]
# The port runs here. In fp32 it must train what one process trains (the same script on one
# rank), to 1e-5; with the default bf16 policy it runs too (gloo all-gathers bf16):

# %%
port_dir = Path(tempfile.mkdtemp(prefix="lesson02-port-"))
for nproc, dtype in ((2, "float32"), (1, "float32"), (2, "bfloat16")):
    # torchrun --standalone --nproc-per-node NPROC lessons/fsdp2_train.py OUT --param-dtype D
    run_script(fsdp2_path, nproc, [port_dir / f"{dtype}-{nproc}.pt", "--param-dtype", dtype],
               timeout_s=180)
two, one = (torch.load(port_dir / f"float32-{n}.pt", weights_only=True) for n in (2, 1))
port_parity = max((two[k] - one[k]).abs().max().item() for k in one)
print(f"FSDP2 port, fp32, 2 ranks against 1: max |param diff| {port_parity:.1e}; "
      f"keys {list(one)[:3]} ... ({len(one)})")
assert two.keys() == one.keys() and port_parity <= 1e-5
assert (port_dir / "bfloat16-2.pt").exists()

# %% [markdown]
# Against FSDP1 itself the comparison needs GPUs: `tests/test_fsdp_migration.py` runs both
# scripts on 2 GPUs in fp32 and compares every parameter within 1e-5 (GPU only, skipped with
# its reason on this machine, so not executed in CI). The state-dict keys are the same in both
# (`0.norm.weight`, ...): FSDP1's full state dict strips its wrapper prefixes, and
# `get_model_state_dict` returns the model's own names.
#
# | FSDP1 (`FullyShardedDataParallel`) | FSDP2 (`fully_shard`, torch >= 2.6) |
# |---|---|
# | `FSDP(model, auto_wrap_policy=transformer_auto_wrap_policy(...))` | `fully_shard(block)` for each block, then `fully_shard(model)` |
# | one `FlatParameter` per wrapped unit | each parameter a `DTensor` with `Shard(0)` |
# | `ShardingStrategy.FULL_SHARD` | `reshard_after_forward=True` (the default `None` means `True` except for the root, which stays gathered) |
# | `ShardingStrategy.SHARD_GRAD_OP` | `reshard_after_forward=False` |
# | `ShardingStrategy.HYBRID_SHARD` | a 2D mesh `(replicate, shard)`: `init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("dp_replicate", "dp_shard"))` |
# | `ShardingStrategy.NO_SHARD` | a mesh whose shard dimension has size 1, or DDP |
# | `MixedPrecision(param_dtype=..., reduce_dtype=..., buffer_dtype=...)` | `MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)` |
# | `CPUOffload(offload_params=True)` | `CPUOffloadPolicy()` |
# | `with model.no_sync():` | `model.set_requires_gradient_sync(False)` |
# | `FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)` | `get_state_dict` / `set_state_dict` + `torch.distributed.checkpoint` |
# | `FSDP.clip_grad_norm_(...)` | `torch.nn.utils.clip_grad_norm_` (works on DTensor grads) |
#
# ## Wrong advice that circulates
#
# Three claims in widely copied notes, checked against the installed torch:

# %%
try:
    from torch.distributed.fsdp import HybridShard  # noqa: F401
    hybrid_shard_exists = True
except ImportError as exc:
    hybrid_shard_exists = False
    print("ImportError:", exc)
assert not hybrid_shard_exists  # there is no HybridShard class; HSDP is a 2D mesh

from torch.distributed.fsdp import ShardingStrategy  # noqa: E402

doc = " ".join(ShardingStrategy.__doc__.split())
hybrid = doc[doc.index("``HYBRID_SHARD``"):].split(". ")[0]
print(hybrid)
assert "within a node, and replicate parameters across nodes" in hybrid
assert "(Replicate(), Shard(dim=0))" in ws4[0]["hsdp"]["layout"][0]  # FSDP2: same idea, in a mesh

from torch.distributed.fsdp import fully_shard  # noqa: E402

major, minor = (int(x) for x in torch.__version__.split(".")[:2])
print(f"torch {torch.__version__}: from torch.distributed.fsdp import fully_shard -> "
      f"{fully_shard.__module__}")
assert (major, minor) >= (2, 6)

# %% [markdown]
# - **"`HybridShard(intra_node_sharding_strategy=..., inter_node_sharding_strategy=...)`"**:
#   no such class. FSDP1 spells it `sharding_strategy=ShardingStrategy.HYBRID_SHARD`; FSDP2 spells
#   it as a 2D mesh.
# - **"HYBRID_SHARD replicates inside a node and shards across nodes"**: backwards. It shards
#   *within* a node (fast links carry the all-gathers and reduce-scatters) and replicates
#   *across* nodes (only an all-reduce of gradient shards crosses the slow network). The lab's
#   `--hsdp R` puts the shard axis last (inner, consecutive ranks) for the same reason.
# - **"FSDP2 since PyTorch 2.0"**: `fully_shard` first shipped in 2.4 as a prototype under
#   `torch.distributed._composable.fsdp`, and became public as `torch.distributed.fsdp.fully_shard`
#   in 2.6 (pytorch/pytorch PR #141868). Use it on 2.6 or newer; the import above is the proof on
#   this install, not for older versions.
#
# ## Summary
#
# - Persistent state per rank: DDP 16 B/param in fp32 + AdamW, whatever N; ZeRO-3/FSDP 16/N.
#   Measured here within 5% of the estimator, and FSDP within 5% of DDP / N.
# - FSDP = shard + all-gather before use + reduce-scatter after backward; by hand it gives the
#   same numbers as `fully_shard`. It sends about 1.5x DDP's bytes for 1/N of the memory.
# - HSDP shards inside a group (a node) and replicates across groups: only an all-reduce of
#   gradient shards crosses the slower links.
# - Build on meta, `fully_shard` blocks then the root, `to_empty`, fill your shards.
# - The peak is more than the table: the gathered unit, its prefetch, activations, buffers.
#
# ## Exercises
#
# - **Graded:** a ZeRO-1 sharded optimizer. Fill in `exercises/zero1.py`, then run
#   `python exercises/grade.py zero1`: it checks your code against one process, check by check
#   ([the exercises](../exercises/README.md)).
# - **Graded:** FSDP by hand (shard, all-gather, free, reduce-scatter). Fill in `exercises/fsdp.py`, then run
#   `python exercises/grade.py fsdp`: it checks your code against one process, check by check
#   ([the exercises](../exercises/README.md)).
#
# Each exercise below is checked: it has a self-check (a Python block your answer must pass)
# and a worked answer, collapsed, in [the exercise book](../docs/onboarding-exercises.md).
#
# 1. **The 70B memory table**: a 70B model's state per rank under FSDP, and an 8B model's in
#    mixed precision
#    ([onboarding exercise 2.1](../docs/onboarding-exercises.md#exercise-21-the-70b-memory-table)).
# 2. **Every byte FSDP holds**: the padded shards lab02 measures on 2 ranks when the vocabulary
#    does not split evenly
#    ([onboarding exercise 2.2](../docs/onboarding-exercises.md#exercise-22-every-byte-fsdp-holds)).
# 3. **Read a sharded checkpoint without torchrun**: which piece of every tensor each rank
#    wrote into the DCP checkpoint
#    ([onboarding exercise 2.3](../docs/onboarding-exercises.md#exercise-23-read-a-sharded-checkpoint-without-torchrun)).
# 4. **HSDP on 512 GPUs**: the state per rank and the traffic across replicas under `--hsdp`,
#    and the smallest shard group that holds a 70B model
#    ([onboarding exercise 2.4](../docs/onboarding-exercises.md#exercise-24-hsdp-on-512-gpus)).
#
# ## If it breaks
#
# - Out of memory, or memory above the estimate: [OOM: distributed causes](../runbooks/oom-distributed-causes.md)
#   and [OOM: mitigations](../runbooks/oom-mitigations.md).
# - A rank hangs in an all-gather or reduce-scatter: every wait in the lab is bounded by
#   `--timeout-s` (default 120 s), passed to `init_process_group` and to every mesh axis
#   (`init_mesh()`: `init_device_mesh`'s sub-groups would wait 30 min on gloo, 10 on NCCL), so
#   a stuck collective becomes an error instead of a silent hang
#   ([collective timeout, cause D](../runbooks/collective-timeout.md)).
# - A resume picks the wrong checkpoint: only `step_*` directories holding DCP's `.metadata`
#   count (`lab.latest_checkpoint`); a `.tmp` directory is a save that never finished.
