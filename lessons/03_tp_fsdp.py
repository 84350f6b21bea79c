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
# # 03 · Tensor parallel inside a node, FSDP across nodes
#
# After this lesson you can:
#
# - say why tensor parallelism (TP) belongs on the fast links inside a node and FSDP across
#   nodes, with numbers;
# - split an MLP column-parallel then row-parallel by hand and check it against `nn.Linear`,
#   forward and backward;
# - read DTensor placements on a 2D `("dp", "tp")` mesh and say what each rank holds;
# - write a per-block TP plan (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`,
#   `PrepareModuleInput`, loss parallel), apply it before `fully_shard`, and guard its keys;
# - predict a step's collectives from the Megatron-LM analysis and check them with
#   `CommDebugMode`;
# - lay out a real cluster: 8 nodes x 8 GPUs with tp = 4 is the mesh (16, 4).
#
# Everything runs on a laptop CPU over gloo; on GPUs the same code uses NCCL.

# %%
import inspect
import os
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch.distributed.tensor import Replicate, Shard

ROOT = Path(os.environ.get("COURSE_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "labs" / "lab01_ddp.py").exists()))
sys.path.insert(0, str(ROOT / "lessons"))
sys.path.insert(0, str(ROOT / "labs"))

import lab03_tp_fsdp as lab  # noqa: E402  (importable: nothing runs at import)
import tp_workers  # noqa: E402  (worker functions live in a module: spawn re-imports them)
from labkit.loop import learning_rate  # noqa: E402  (the labs' warmup schedule)
from spawn import launch_lab, run_workers  # noqa: E402

# %% [markdown]
# ## Why
#
# FSDP shards parameters, gradients and optimizer state, but every rank still runs whole
# layers on its own micro-batch, so **activations** are not sharded. At long sequences they
# dominate. Tensor parallelism (TP) splits each layer's matmuls over t ranks, so each rank keeps
# a slice of most activations; *sequence parallelism* (SP), used with TP, also splits the norms
# and the residual stream along the sequence, so those shrink by t too.
#
# Korthikanti et al. (arXiv:2205.05198, Table 2) count the activation bytes one
# transformer layer keeps for backward (16-bit activations, no recomputation), with sequence
# length s, micro-batch b, width h, heads a and TP degree t:
#
# | layout | bytes per layer |
# |---|---|
# | no TP | s b h (34 + 5 a s / h) |
# | TP | s b h (10 + 24 / t + 5 a s / (h t)) |
# | TP + sequence parallel | s b h (34 / t + 5 a s / (h t)) |
#
# The 5 a s / h terms are the stored s x s attention scores, which FlashAttention does not keep
# (lesson 02 counts the difference: about 485 against 85 GiB at t = 1), and the 34 assumes
# standard multi-head attention and a 4h GELU MLP; for Llama the figures below are an upper
# estimate, and what TP and SP divide stays the same.
#
# For a Llama-2-70B-sized layer (h = 8192, a = 64, 80 layers) at s = 4096, b = 1:

# %%
s, b, h, a, num_layers = 4096, 1, 8192, 64, 80


def activation_gib(t, sequence_parallel):
    if t == 1:
        per_layer = s * b * h * (34 + 5 * a * s / h)
    elif sequence_parallel:
        per_layer = s * b * h * (34 / t + 5 * a * s / (h * t))
    else:
        per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    return num_layers * per_layer / 2**30


for t in (1, 8):
    print(f"t = {t}: {activation_gib(t, False):6.1f} GiB, "
          f"with SP {activation_gib(t, True):6.1f} GiB")
assert activation_gib(1, False) > 80  # more than a whole 80 GB GPU, for activations alone
assert activation_gib(8, True) < activation_gib(8, False) < activation_gib(1, False) / 5

# %% [markdown]
# TP pays for this with communication *inside every layer*: (as counted below) two all-reduces
# of an (s, b, h) activation in forward and two in backward per layer, every micro-batch. A ring
# all-reduce moves 2 (t - 1) / t times the tensor through each rank. The link speeds below are
# assumptions for illustration (vendor-class figures, not measured here): about 450 GB/s per
# direction between GPUs of one node (NVLink class), about 50 GB/s per GPU between nodes
# (a 400 Gb/s NIC).

# %%
t = 8
tensor_bytes = s * b * h * 2  # one bf16 activation
tp_bytes_per_rank = num_layers * 4 * 2 * (t - 1) / t * tensor_bytes
links = {"inside a node (~450 GB/s)": 450e9, "across nodes (~50 GB/s)": 50e9}
for link, bytes_per_s in links.items():
    print(f"TP traffic per micro-batch: {tp_bytes_per_rank / 1e9:.1f} GB -> "
          f"{tp_bytes_per_rank / bytes_per_s * 1e3:.0f} ms {link}")
assert tp_bytes_per_rank / 50e9 > 5 * tp_bytes_per_rank / 450e9

# %% [markdown]
# Tens of GB per micro-batch, on the critical path of every layer: under a tenth of a second
# inside a node, most of a second across nodes, for every micro-batch. FSDP's traffic is not
# smaller: with t = 8, each rank still all-gathers its TP slice, 1/8 of the bf16 weights
# (70e9 x 2 B / 8, about 17.5 GB), in the forward and again in the backward of *every*
# micro-batch (gradient accumulation does not save those), and reduce-scatters the gradients
# once per step. But nothing inside a layer waits for it: the next block's all-gather can run
# while this block computes (on a GPU, on a stream of its own; lesson 06 explains how). TP's all-reduces sit between two matmuls of the same layer, so nothing hides them.
# Hence the 2D layout: **TP inside a node, on the fast links; FSDP across nodes.**
#
# ## From scratch: column-parallel, then row-parallel
#
# Megatron-LM (Shoeybi et al., arXiv:1909.08053) splits an MLP `y = gelu(x A) B` so that only
# one collective is needed each way: `A` by output features (column-parallel: each rank
# computes a slice of the hidden units, and gelu is elementwise so no exchange is needed), `B`
# by input features (row-parallel: each rank gets a *partial sum* of y). Forward all-reduces
# the partial sums (Megatron's `g`); backward all-reduces the input gradient (`f`), because each
# rank's slice contributed part of dL/dx. In code, `A` is `fc1.weight.T`: `nn.Linear` stores its
# weight as (out, in), so splitting A's columns means splitting `fc1.weight`'s rows, and
# splitting B's rows means splitting `fc2.weight`'s columns. The picture draws the stored
# weights, for the 2-rank example below (8 inputs, 16 hidden units):

# %%
fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), gridspec_kw={"width_ratios": [1, 2]})
rank_colors = ["tab:blue", "tab:orange"]
for r in range(2):  # fc1.weight (A transposed), 16 x 8: rank r keeps output rows 8r .. 8r+7
    axes[0].add_patch(plt.Rectangle((0, 8 * r), 8, 8, color=rank_colors[r], alpha=0.75))
    axes[0].text(4, 8 * r + 4, f"rank {r}\nrows {8 * r}-{8 * r + 7}", ha="center", va="center",
                 fontsize=11, color="white", fontweight="bold")
    # fc2.weight (B transposed), 8 x 16: rank r keeps input columns 8r .. 8r+7 (the same hidden units)
    axes[1].add_patch(plt.Rectangle((8 * r, 0), 8, 8, color=rank_colors[r], alpha=0.75))
    axes[1].text(8 * r + 4, 4, f"rank {r}\ncolumns {8 * r}-{8 * r + 7}", ha="center",
                 va="center", fontsize=11, color="white", fontweight="bold")
axes[0].set(xlim=(0, 8), ylim=(16, 0), xlabel="input features (8)", ylabel="hidden units (16)")
axes[0].set_title("fc1.weight = A transposed: A's columns\nare these rows (column-parallel)",
                  fontsize=11)
axes[1].set(xlim=(0, 16), ylim=(8, 0), xlabel="hidden units (16)", ylabel="outputs (8)")
axes[1].set_title("fc2.weight = B transposed: B's rows are these\ncolumns (row-parallel), "
                  "partial sums all-reduced (g)", fontsize=11)
for ax in axes:
    ax.set_aspect("equal")
    ax.tick_params(labelsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# `tp_workers.py` builds `f` and `g` as autograd functions and checks the split MLP against
# `nn.Linear` on two processes. This is all of it:

# %%
for function in (tp_workers.CopyToTP, tp_workers.ReduceFromTP, tp_workers.column_row_by_hand):
    print(inspect.getsource(function))

# %%
by_hand = run_workers(tp_workers.column_row_by_hand, 2, timeout_s=240)
for rank, r in enumerate(by_hand):
    print(f"rank {rank}: A slice {r['a_shape']}, B slice {r['b_shape']} | max diff: out "
          f"{r['out_diff']:.1e}, dx {r['x_grad_diff']:.1e}, dA {r['a_grad_diff']:.1e}, "
          f"dB {r['b_grad_diff']:.1e}")
for r in by_hand:
    assert r["a_shape"] == r["b_shape"] == (8, 8)  # half of the 16 hidden units each
    assert max(r["out_diff"], r["x_grad_diff"], r["a_grad_diff"], r["b_grad_diff"]) < 1e-6

# %% [markdown]
# Equal to rounding (about 1e-7 in fp32): the differences are summation order, not math.
#
# ## DTensor placements, made visible
#
# PyTorch expresses these layouts with DTensor: a tensor plus a mesh plus one *placement* per
# mesh axis (`Replicate()`, `Shard(dim)`, or `Partial()` for pending sums). Here one 4x4
# tensor (values 0..15) is laid out four ways on a 2D mesh of 4 ranks, `("dp", "tp") = (2, 2)`.
# (One set of 4 processes runs this and the two later 4-rank demos; each section reads its part.)

# %%
tour = run_workers(tp_workers.tour_2d, 4, timeout_s=240)
placed = [r["placements"] for r in tour]
for layout in placed[0]["local"]:
    print(layout)
    for rank, r in enumerate(placed):
        print(f"  rank {rank} at (dp, tp) = {tuple(r['coordinate'])}: {r['local'][layout]}")
two_d = [r["local"]["(Shard(0), Shard(1))"] for r in placed]
assert two_d[3] == [[10.0, 11.0], [14.0, 15.0]]  # rank 3 = (dp 1, tp 1): bottom-right block
replicated = [r["local"]["(Replicate(), Replicate())"] for r in placed]
assert all(local == replicated[0] for local in replicated)  # every rank holds all 16 values

# %% [markdown]
# ## With PyTorch: the lab's plan
#
# `labs/lab03_tp_fsdp.py` applies the Megatron plan **per transformer block**, with keys relative
# to the block, then the embedding and output projection explicitly. The plan as the lab builds
# it (without and with sequence parallel):

# %%
cfg = lab.parse_config(["--tp", "1"])
for sp in (False, True):
    cfg.sequence_parallel = sp
    print(f"--- block plan, sequence parallel {sp}")
    for key, style in lab.block_plan(cfg).items():
        print(f"  {key:16s} {style}")
print("--- root plan (with --loss-parallel)")
cfg.loss_parallel = True
for key, style in lab.root_plan(cfg).items():
    print(f"  {key:16s} {style}")

# %% [markdown]
# Things to notice, each explained by a comment in the lab:
#
# - **Heads.** `ColwiseParallel` on `wq/wk/wv` gives each rank `num_heads / tp` heads. The lab's
#   `Attention` infers its head count from the projection width (`view(bsz, seq, -1,
#   head_dim)`), so no module attribute has to be adjusted; `inspect_tp_fsdp` asserts the local
#   width.
# - **`PrepareModuleInput(..., use_local_output=False)`** on `attention` and `feed_forward`:
#   `PrepareModuleInput` turns the module's input into a DTensor laid out as the plan says, and
#   `use_local_output=False` passes that DTensor on instead of its local tensor. So the three
#   projections share one DTensor input, backward sums their input gradients as a DTensor, and
#   the all-reduce (Megatron's `f`) runs **once**, not once per projection.
# - **Sequence parallel.** Between blocks the activations are `Shard(1)` (sequence); the norms
#   run on local tokens; entering attention/MLP all-gathers, leaving reduce-scatters.
# - **Loss parallel.** Without it the output projection gathers the full logits (batch x seq x
#   vocab) on every TP rank before the loss. With `--loss-parallel` it leaves them sharded by
#   vocabulary (`Shard(-1)`), and `loss_parallel()` computes the cross-entropy on the shards:
#   the ranks all-reduce a few numbers per token (the max, the sum of exponentials, the
#   target's logit), never the logits.
# - **Order.** TP first, then `fully_shard` per block and the root on the `"dp"` sub-mesh.
#
# The sequence-parallel bullet, drawn for one block as this plan lays it out. `PrepareModuleInput`
# all-gathers the sequence where it enters attention and the MLP; the row-parallel `wo` and `w2`
# reduce-scatter their partial sums straight back to `Shard(1)`. Backward mirrors it: an
# all-gather's gradient is a reduce-scatter, and the other way round.

# %%
fig, ax = plt.subplots(figsize=(12, 3.4))
seq_color, tp_color = "tab:green", "tab:blue"
boxes = [  # (left x, width, text, colour): one block in forward, left to right
    (1.6, 2.4, "attention_norm\non own tokens", seq_color),
    (5.5, 3.2, "attention\nwq/wk/wv: heads / t\nwo: partial sums", tp_color),
    (11.4, 2.4, "ffn_norm\non own tokens", seq_color),
    (15.3, 3.2, "MLP\nw1/w3: hidden / t\nw2: partial sums", tp_color),
]
for x, width, text, color in boxes:
    ax.add_patch(plt.Rectangle((x, 1.4), width, 1.2, color=color, alpha=0.3))
    ax.text(x + width / 2, 2.0, text, ha="center", va="center", fontsize=9.5)
    ax.text(x + width / 2, 1.1, "(b, s/t, h)" if color == seq_color else "input (b, s, h)",
            ha="center", va="center", fontsize=9, color="dimgray")
arrows = [(1.0, 1.6, ""), (4.0, 5.5, "all-gather"), (8.7, 10.2, "reduce-\nscatter"),
          (10.8, 11.4, ""), (13.8, 15.3, "all-gather"), (18.5, 20.0, "reduce-\nscatter"),
          (20.6, 21.2, "")]
for x0, x1, label in arrows:  # (from x, to x, the collective on that edge)
    ax.annotate("", xy=(x1, 2.0), xytext=(x0, 2.0), arrowprops={"arrowstyle": "->", "lw": 1.5})
    ax.text((x0 + x1) / 2, 2.1, label, ha="center", va="bottom", fontsize=9, color="tab:red")
for x in (10.5, 20.3):  # residual adds: both operands are Shard(1)
    ax.plot(x, 2.0, "o", markersize=18, markerfacecolor="white", markeredgecolor="black")
    ax.text(x, 2.0, "+", ha="center", va="center", fontsize=12)
    ax.text(x, 1.1, "(b, s/t, h)", ha="center", va="center", fontsize=9, color="dimgray")
for x0, x1 in [(0.5, 10.5), (11.1, 20.3)]:  # the residual stream skips each sublayer
    ax.plot([x0, x0, x1], [2.45 if x0 < 1 else 2.0, 3.3, 3.3], color="gray", lw=1.2)
    ax.annotate("", xy=(x1, 2.3), xytext=(x1, 3.3),
                arrowprops={"arrowstyle": "->", "color": "gray"})
ax.text(0.5, 2.0, "x\nShard(1)", ha="center", va="center", fontsize=9.5)
ax.text(21.9, 2.0, "out\nShard(1)", ha="center", va="center", fontsize=9.5)
ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=seq_color, alpha=0.3),
                   plt.Rectangle((0, 0), 1, 1, color=tp_color, alpha=0.3)],
          labels=["Shard(1): s/t tokens per rank", "TP: whole sequence, weights split"],
          loc="lower center", ncol=2, fontsize=9, frameon=False)
ax.set(xlim=(-0.3, 22.7), ylim=(0.2, 3.5))
ax.set_title("One block with sequence parallel (lab03's block_plan), forward", fontsize=11)
ax.axis("off")
fig.subplots_adjust(left=0.0, right=1.0, bottom=0.0, top=0.9)
plt.show()
sp_cfg = lab.parse_config(["--tp", "1"])
sp_cfg.sequence_parallel = True
sp_plan = lab.block_plan(sp_cfg)
for sublayer, row_parallel in [("attention", "attention.wo"), ("feed_forward", "feed_forward.w2")]:
    assert sp_plan[sublayer].input_layouts == (Shard(1),)  # enters sequence-sharded ...
    assert sp_plan[sublayer].desired_input_layouts == (Replicate(),)  # ... and is all-gathered
    assert sp_plan[row_parallel].output_layouts == (Shard(1),)  # partial sums reduce-scattered
assert {type(sp_plan[norm]).__name__ for norm in ("attention_norm", "ffn_norm")} == {
    "SequenceParallel"}

# %% [markdown]
# The asserts read these layouts from the lab's plan, and
# [the Megatron-LM count](#the-megatron-lm-count-checked) below finds the two all-gathers and
# two reduce-scatters in a real step.
#
# On a (2, 2) mesh each weight ends up with 2D placements. The table lists block 0's parameters
# as rank 0, at (dp, tp) = (0, 0), holds them. "sharded placements" has one placement per mesh
# axis, `"dp"` first. "sharded" is the local shape between steps, what the optimizer steps: a
# quarter of each TP'd weight. "tp-local" is the local shape after FSDP's all-gather over
# `"dp"` (`unshard()`): the slice the matmuls use.
#
# `_StridedShard(dim=0, sf=2)` marks a dim that TP and FSDP both split. `ColwiseParallel` gives
# each tp rank 32 of wq's 64 rows, and FSDP's `Shard(0)` splits those 32 again over `"dp"`. So
# rank (dp d, tp t) holds rows 32 t + 16 d to 32 t + 16 d + 15: dp index 0 holds rows 0-15 (on
# tp rank 0) and 32-47 (on tp rank 1), strided, not the rows 0-31 a plain `Shard(0)` on `"dp"`
# would give it. `sf=2` counts the tp slices that were cut first.

# %%
layout = [r["layout"] for r in tour]
print(f"{'parameter':26s} {'sharded placements':44s} {'sharded':>10s} {'tp-local':>10s}")
for name, row in layout[0]["params"].items():
    print(f"{name:26s} {row['placements']:44s} {str(row['sharded_local']):>10s} "
          f"{str(row['tp_local']):>10s}")
wq = layout[0]["params"]["attention.wq.weight"]
assert wq["global"] == (64, 64) and wq["tp_local"] == (32, 64) and wq["sharded_local"] == (16, 64)
assert layout[0]["params"]["attention_norm.weight"]["tp_placements"] == "-"  # plain: not TP'd

# %% [markdown]
# So the all-gather over `"dp"` (ranks 0 and 2, both tp rank 0) rebuilds exactly tp rank 0's
# rows 0-31: the tp-local (32, 64). `wo` and `w2` need no striding: TP splits their dim 1,
# FSDP their dim 0.
#
# The lab clips gradients (`--clip`, 1.0 by default) with labkit's `clip_grad_norm_`
# (`labs/labkit/loop.py`): each rank takes the norm of its own gradient shards, DTensor's
# `full_tensor()` all-reduces the squares over each mesh axis, and every rank clips by the norm
# of the whole model's gradient. Without sequence parallel the norm weights are not TP'd, so
# their gradients live on the `"dp"` mesh only and the others on `("dp", "tp")`; one
# `torch.stack` cannot mix meshes, so the lab sums squares per mesh, then combines.
#
# ## What goes wrong
#
# Four mistakes, run on 4 ranks: block keys handed to the root model, FSDP applied before TP,
# and two wrong mesh sizes.

# %%
per_rank = [r["mistakes"] for r in tour]
mistakes = per_rank[0]
for key, value in mistakes.items():
    print(f"{key}: {value}")
small_mesh = [r["small_mesh_coordinate"] for r in per_rank]
print("coordinates in a (1, 2) mesh on 4 ranks:", small_mesh)
assert small_mesh[2] is None and small_mesh[3] is None  # ranks 2 and 3 are not in the mesh
assert mistakes["root_plan_warnings"] and not mistakes["root_plan_wq_is_dtensor"]
assert "'attention.wq' matches no submodule of TinyLlama" in mistakes["guard"]
assert "Cannot distribute a DTensor" in mistakes["fsdp_then_tp"]
assert "Mesh should not be bigger than default world size" in mistakes["mesh_too_big"]

# %% [markdown]
# - A plan key that matches nothing is **only a warning**: `wq` stayed a plain, full tensor on
#   every rank. The lab's `check_plan_keys` turns that into a `ValueError` naming the key.
# - FSDP first fails: `fully_shard` already made the weights DTensors on the `"dp"` mesh, and
#   TP cannot re-distribute them onto `"tp"`.
# - A mesh bigger than the world raises; a smaller one does **not**: ranks 2 and 3 got the
#   coordinate `None`. They are outside the mesh and would sit idle, or hang the first
#   collective that expects them.
#
# ## Run the lab
#
# Four ranks, three mesh shapes (dp, tp) = (4, 1), (2, 2), (1, 4), without and with sequence
# parallel. Each run keeps the per-rank micro-batch at 4 sequences (`--batch-size 4 x dp`), so
# the comparison isolates what TP divides. `--check-parity` trains the same batches in one process
# and compares every parameter in fp32 (within 1e-5); `--count-comms` measures step 1
# with `CommDebugMode` and counts the bytes autograd saves for backward.
#
# <details><summary>How these runs are launched</summary>
#
# The runs fork their ranks from a server that has already imported torch (`launch_lab` in
# `lessons/spawn.py`), with the environment torchrun gives each rank: the same run as the
# `torchrun` command in `run_lab`'s docstring, and about 10 s less start-up each on a 2-core
# laptop.
# </details>

# %%
workdir = Path(tempfile.mkdtemp(prefix="lesson03-"))


def run_lab(nproc, *args):
    """torchrun --standalone --nproc-per-node nproc labs/lab03_tp_fsdp.py ARGS, with the ranks
    forked as torchrun would start them (spawn.launch_lab)."""
    out = workdir / f"run-{len(list(workdir.iterdir()))}.json"
    return launch_lab(ROOT / "labs" / "lab03_tp_fsdp.py", nproc, args, out)


runs = {}
for tp, sp in [(1, False), (2, False), (2, True), (4, False), (4, True)]:
    dp = 4 // tp
    runs[tp, sp] = run_lab(4, "--tp", tp, "--batch-size", 4 * dp, "--steps", 2, "--check-parity",
                           "--count-comms", *(["--sequence-parallel"] if sp else []))
assert all(m["parity_max_abs_diff"] <= 1e-5 for m in runs.values())

# %% [markdown]
# Parity holds on every mesh, in fp32, within 1e-5. That needs the labs' learning-rate warmup,
# for a reason [the section before the Summary](#why-fp32-parity-needs-warmup-adamws-first-step) measures.
#
# ### Memory per rank against tp
#
# TP divides activations; the 2-D mesh divides the state. Expect flat state per rank and falling
# activations as tp grows:

# %%
tps = [1, 2, 4]
state = [{k: v[0] for k, v in runs[t, False]["state_bytes_per_rank"].items()} for t in tps]
acts = [runs[t, False]["activation_bytes_per_rank"][0] / 2**20 for t in tps]
acts_sp = [runs[t, t > 1]["activation_bytes_per_rank"][0] / 2**20 for t in tps]
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
left.plot(tps, [(s["params"] + s["optimizer"]) / 2**20 for s in state], "o-")
left.set(title="params + AdamW state per rank", xlabel="tp (dp = 4 / tp)", ylabel="MiB",
         xticks=tps, ylim=(0, None))
right.plot(tps, acts, "o-", label="TP")
right.plot(tps, acts_sp, "s--", label="TP + sequence parallel")
right.set(title="saved activations per rank (micro-batch 4)", xlabel="tp", ylabel="MiB",
          xticks=tps, ylim=(0, None))
right.legend()
plt.show()
print("activation MiB, TP:", [f"{x:.2f}" for x in acts], "TP+SP:", [f"{x:.2f}" for x in acts_sp])
params = [s["params"] for s in state]
assert max(params) < 1.01 * min(params)  # 2D sharding: every mesh shape splits 4 ways
assert acts[0] > acts[1] > acts[2] and acts_sp[1] < acts[1] and acts_sp[2] < acts[2]

# %% [markdown]
# Parameters and optimizer state are split over all four ranks whatever the shape, so they stay
# flat (the norm weights, replicated over tp with or without SP, are the one tiny exception). Saved activations fall as tp grows, and fall further with sequence parallel, which also
# splits the norms and the residual stream.
#
# ### Communication per step against tp
#
# As tp grows, FSDP's traffic shrinks and TP's appears: FSDP's bytes are weights and
# gradients, TP's are activations, in every layer. The plot splits the bytes each rank sends in
# one step between the two.
#
# <details><summary>How the bytes are counted</summary>
#
# `CommDebugMode` names every collective. TP's come from DTensor (`c10d_functional.*`), FSDP's
# from `fully_shard` (`c10d.*`), so one step's traffic splits cleanly by name.
#
# `CommCounter`, in the lab kit (`labs/labkit/probes.py`, its `__torch_dispatch__`), counts the
# bytes each rank *sends*, with lesson 00's ring factors: for a group of n ranks and a full
# tensor of S bytes, an all-reduce sends 2 (n-1)/n x S, an all-gather or a reduce-scatter
# (n-1)/n x S.
#
# Counting "the tensor a collective touches" instead would mix two accountings: DTensor's
# functional all-gather sees only the local shard (the counter multiplies it by n - 1), FSDP's
# sees the gathered output.
# </details>

# %%
def wire_mib(metrics, prefix):
    return sum(v for k, v in metrics["comm_wire_bytes_per_step"].items()
               if k.startswith(prefix)) / 2**20


fig, ax = plt.subplots(figsize=(6, 3.5))
for sp, style in [(False, "o-"), (True, "s--")]:
    ax.plot(tps, [wire_mib(runs[t, sp and t > 1], "c10d_functional.") for t in tps], style,
            label=f"TP collectives{' (SP)' if sp else ''}")
ax.plot(tps, [wire_mib(runs[t, False], "c10d.") for t in tps], "^:", label="FSDP collectives")
ax.set(title="bytes sent per step per rank", xlabel="tp (dp = 4 / tp)", ylabel="MiB",
       xticks=tps)
ax.legend()
plt.show()
fsdp = [wire_mib(runs[t, False], "c10d.") for t in tps]
tp_traffic = [wire_mib(runs[t, False], "c10d_functional.") for t in tps]
print("FSDP MiB:", [f"{x:.3f}" for x in fsdp], "TP MiB:", [f"{x:.3f}" for x in tp_traffic])
assert fsdp[0] > fsdp[1] > fsdp[2] and tp_traffic[1] > 10 * tp_traffic[0]

# %% [markdown]
# FSDP's traffic shrinks as tp grows (each dp rank gathers only its tp-local slice, and at
# dp = 1 there is nothing to gather); TP's traffic appears as soon as tp > 1 and is
# activation-sized. At tp = 1 the only TP-side collectives left are the gradient-norm
# reductions of clipping (a few scalars per step).
#
# ### The Megatron-LM count, checked
#
# Per block, the analysis predicts: without SP, two all-reduces forward (after `wo` and `w2`)
# and two backward (the `f` before attention and MLP); with SP, each all-reduce becomes an
# all-gather / reduce-scatter pair, plus one small all-reduce per norm for its weight gradient,
# which is partial because each rank saw only its tokens.

# %%
def tp_only(counts):
    return {k.split(".")[-1]: v for k, v in counts.items() if k.startswith("c10d_functional.")}


for sp in (False, True):
    block = runs[2, sp]["comm_counts_block0"]
    print(f"SP {sp}: forward {tp_only(block['forward'])} | backward {tp_only(block['backward'])}")
assert tp_only(runs[2, False]["comm_counts_block0"]["forward"]) == {"all_reduce": 2}
assert tp_only(runs[2, False]["comm_counts_block0"]["backward"]) == {"all_reduce": 2}
assert tp_only(runs[2, True]["comm_counts_block0"]["forward"]) == {
    "all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
assert tp_only(runs[2, True]["comm_counts_block0"]["backward"]) == {
    "all_gather_into_tensor": 2, "reduce_scatter_tensor": 2, "all_reduce": 2}

# %% [markdown]
# An all-reduce costs what a reduce-scatter plus an all-gather cost (that is how ring
# all-reduce works: 2 (n-1)/n = (n-1)/n + (n-1)/n), so sequence parallel sends the same bytes
# as plain TP while sharding activations that plain TP keeps whole. Measured, per step and
# rank, the only difference is SP's extra all-reduce of each norm's weight gradient (5 norms
# of 64 fp32 values here, `2 x num_layers + 1` norms):

# %%
defaults = lab.parse_config(["--tp", "1"])  # the model the runs above trained
num_norms = 2 * defaults.num_layers + 1     # two per block, plus the final one
for t in (2, 4):
    tp_bytes = wire_mib(runs[t, False], "c10d_functional.") * 2**20
    sp_bytes = wire_mib(runs[t, True], "c10d_functional.") * 2**20
    norm_grads = num_norms * defaults.dim * 4 * 2 * (t - 1) / t  # one all-reduce per norm
    print(f"tp = {t}: TP {tp_bytes:,.0f} B, TP + SP {sp_bytes:,.0f} B "
          f"(difference {sp_bytes - tp_bytes:,.0f} B; norm weight grads {norm_grads:,.0f} B)")
    assert abs(sp_bytes - tp_bytes - norm_grads) <= 64  # a few 4-byte scalars of grad norms
    assert abs(sp_bytes / tp_bytes - 1) < 0.01

# %% [markdown]
# ## A worked cluster plan
#
# 8 nodes x 8 GPUs = 64 ranks, tp = 4. The mesh must cover every rank: dp = 64 / 4 = 16, so
# `init_device_mesh("cuda", (16, 4), mesh_dim_names=("dp", "tp"))` (the lab builds the same
# layout with `init_mesh`, which also gives every axis the job's timeout). A common mistake is
# `(8, 4)`: that is 32 ranks. A mesh bigger than the world raises (above); a smaller one silently
# leaves ranks out. With `"tp"` as the last axis, each TP group is 4 consecutive ranks, and
# torchrun numbers the ranks of one node consecutively, so TP never crosses a node:

# %%
nodes, gpus_per_node, tp = 8, 8, 4
world = nodes * gpus_per_node
mesh = torch.arange(world).reshape(world // tp, tp)  # the layout init_device_mesh uses
tp_groups, dp_groups = mesh.tolist(), mesh.t().tolist()
print(f"mesh {tuple(mesh.shape)}; TP group of rank 13: {tp_groups[13 // tp]}; "
      f"its dp group: {dp_groups[13 % tp]}")
assert tuple(mesh.shape) == (16, 4) and 8 * 4 != world
assert all(len({r // gpus_per_node for r in group}) == 1 for group in tp_groups)  # one node each
assert len({r // gpus_per_node for r in dp_groups[0]}) == nodes  # dp spans all nodes

# %% [markdown]
# The plan is applied per block (`for block in model.layers.values(): parallelize_module(block,
# mesh["tp"], block_plan)`), never once at the root with block-relative keys: those match
# nothing at the root and, as shown above, PyTorch only warns.
#
# ## Why fp32 parity needs warmup: AdamW's first step
#
# The lab runs above match one process within 1e-5 in fp32 only because the labs warm the
# learning rate up from 0. This section measures why (the course's one home for this effect).
#
# Any parallel run sums in another order than one process (TP's half-sums, an all-reduce over
# 3 ranks), so fp32 results differ in their last bits, about 1e-7. AdamW's first step turns
# that into a full step: it is
# `lr * g / (|g| + eps)` with eps = 1e-8, about `lr * sign(g)` for any entry well above eps,
# whatever its size. One AdamW step on one weight, measured:

# %%
def adamw_steps(grads, lrs):
    """One weight after AdamW steps with these gradients and learning rates."""
    weight = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.AdamW([weight], lr=lrs[0], weight_decay=0.0)
    for grad, lr in zip(grads, lrs):
        optimizer.param_groups[0]["lr"] = lr
        weight.grad = torch.tensor([grad])
        optimizer.step()
    return weight.item()


def first_adamw_step(grad, lr=3e-3):
    return abs(adamw_steps([grad], [lr]))


for grad in (1e-2, 1e-6, 1e-7, 1e-8, 1e-12):
    print(f"g = {grad:.0e}: first step moves the weight by {first_adamw_step(grad):.1e}")
assert abs(first_adamw_step(1e-2) - 3e-3) < 1e-7 and first_adamw_step(1e-6) > 2.9e-3
assert abs(first_adamw_step(1e-8) - 1.5e-3) < 1e-5      # g = eps: half a step
assert abs(first_adamw_step(1e-12) - 3e-7) < 1e-9       # far below eps: proportional to g

# %% [markdown]
# So an entry of 1e-7, which can be rounding noise, moves its weight by nearly a full step,
# and another summation order can flip its sign. The labs warm the learning rate up from 0
# (`--warmup-steps 5`, as most transformer recipes do, in `labkit.loop.learning_rate`): step 1
# runs at lr 0 and only fills AdamW's moment estimates. Take a weight whose step-1 gradient is
# rounding noise, +1e-7 in one summation order and -1e-7 in another, and whose step-2 gradient
# is real:

# %%
default = lab.parse_config([])
schedules = {"no warmup": [default.lr] * 2,
             "warmup": [learning_rate(default, step) for step in (1, 2)]}
apart = {}
for name, lrs in schedules.items():
    one_order, other_order = (adamw_steps((noise, 1e-2), lrs) for noise in (1e-7, -1e-7))
    apart[name] = abs(one_order - other_order)
    print(f"{name:9s} (lr {lrs[0]:.1e}, then {lrs[1]:.1e}): after 2 steps {one_order:+.3e} "
          f"and {other_order:+.3e}, {apart[name]:.1e} apart")
assert apart["no warmup"] > 1.5 * default.lr and apart["warmup"] < 1e-6

# %% [markdown]
# Without warmup the noise's sign moved the two copies 2 lr apart at step 1, and step 2 barely
# narrows the gap. With warmup, step 1 moves nothing, and step 2 divides by
# the RMS of both steps' gradients, which the real one dominates: the copies stay together.
# Now the lab itself, three runs of 3 steps on mesh (1, 2), with and without warmup, in fp32
# and float64:

# %%
no_warmup = ["--tp", 2, "--steps", 3, "--check-parity", "--parity-tol", "1e-2",
             "--warmup-steps", 0]
parity_runs = {
    "fp32, no warmup": run_lab(2, *no_warmup),
    "float64, no warmup": run_lab(2, *no_warmup, "--parity-dtype", "float64"),
    "fp32, warmup (the default)": run_lab(2, "--tp", 2, "--steps", 3, "--check-parity"),
}
for name, m in parity_runs.items():
    loss_gap = max(abs(l - r) for (_, l), r in zip(m["losses"], m["reference_losses"]))
    print(f"{name:27s} max |param diff| {m['parity_max_abs_diff']:.1e}   "
          f"max |loss diff| {loss_gap:.1e}")
gaps = [m["parity_max_abs_diff"] for m in parity_runs.values()]
assert gaps[0] > 1e-5 and gaps[1] < 1e-10 and gaps[2] < 1e-6

# %% [markdown]
# Without warmup a few parameters differ by about 1e-4 while the losses agree; in float64 the
# same program agrees to about 1e-13, so the fp32 gap is rounding that AdamW amplified, not a
# bug. With warmup, fp32 parity is back at about 1e-7. When your own parity check fails by a
# little, `--parity-dtype float64` tells a bug (a gap in both dtypes) from rounding (a gap in
# fp32 only).
#
# ## Summary
#
# - TP splits every matmul of a block across the ranks of a TP group: weights *and* activations
#   shrink, at the price of collectives inside every layer, so keep TP on a node's fast links.
# - Column-parallel then row-parallel needs one all-reduce forward and one backward per half
#   block; sequence parallel turns each into an all-gather / reduce-scatter pair and also shards
#   norms and the residual stream.
# - Build order: 2D mesh `("dp", "tp")`, `parallelize_module` per block on `mesh["tp"]`, then
#   `fully_shard` per block and the root on `mesh["dp"]`. Guard plan keys: a typo only warns.
# - TP is exact math but not bitwise. AdamW's first step moves every weight whose gradient is
#   well above eps by about `lr * sign(grad)`, so warm the learning rate up from 0: step 1
#   then moves nothing, and fp32 parity comes back to about 1e-7 (asserted below 1e-6).
#   `--parity-dtype float64` tells a bug from rounding.
#
# ## Exercises
#
# - **Graded:** column- and row-parallel layers by hand, with their collectives written out. Fill in `exercises/tp.py`, then run
#   `python exercises/grade.py tp`: it checks your code against one process, check by check
#   ([the exercises](../exercises/README.md)).
#
# Each exercise below is checked: it has a self-check (a Python block your answer must pass)
# and a worked answer, collapsed, in [the exercise book](../docs/onboarding-exercises.md).
#
# 1. **Lay out a cluster**: the `(dp, tp)` mesh of 64 GPUs at TP 4, and one rank's groups in it
#    ([onboarding exercise 3.1](../docs/onboarding-exercises.md#exercise-31-lay-out-a-cluster)).
# 2. **Column-parallel, then row-parallel, by hand**: a TP MLP's partial sums and the one
#    collective that completes them
#    ([onboarding exercise 3.2](../docs/onboarding-exercises.md#exercise-32-column-parallel-then-row-parallel-by-hand)).
# 3. **What loss parallel saves**: the bytes of the logits' all-gather, and what
#    `--loss-parallel` sends instead
#    ([onboarding exercise 3.3](../docs/onboarding-exercises.md#exercise-33-what-loss-parallel-saves)).
#
# ## If it breaks
#
# - Out of memory after adding TP: [the OOM runbooks](../runbooks/oom-mitigations.md).
# - A rank hangs in a collective (often a mesh that does not cover every rank, or ranks that
#   disagree on the plan): [collective timeouts](../runbooks/collective-timeout.md),
#   [a stuck rank](../runbooks/stuck-rank.md).
# - Start-up hangs: [startup hang](../runbooks/startup-hang.md); everything else:
#   [the runbook index](../runbooks/index.md).
