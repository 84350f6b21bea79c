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
# # 07 · Context parallelism: ring attention for long sequences
#
# After this lesson you can:
#
# - say why long sequences need their own axis: every other axis leaves each rank holding
#   the activations of the *whole* sequence;
# - merge two partial attentions with the log-sum-exp rule, and derive it;
# - run ring attention by hand on 2 and 4 processes, forward and backward, and show its
#   outputs and gradients equal one process's to 1e-6;
# - see the load imbalance that causal masking creates under a naive split, measure it, and
#   remove it with the head-tail (zig-zag) split;
# - measure the activation memory per rank against sequence length: divided by the CP degree;
# - say what torch's own `context_parallel` does, and why it does not run on a CPU.
#
# Everything runs on a laptop CPU over gloo. Tested on torch 2.13.

# %%
import inspect
import math
import os
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import torch

ROOT = Path(os.environ.get("COURSE_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "labs" / "lab01_ddp.py").exists()))
sys.path.insert(0, str(ROOT / "lessons"))

import context_workers as cw  # noqa: E402  (worker functions live in a module: spawn re-imports them)
from spawn import run_workers  # noqa: E402

torch.set_num_threads(1)  # the same single thread per process as the workers below

# %% [markdown]
# ## Why
#
# Data parallelism splits the batch, FSDP the parameters, tensor parallelism the weight
# matrices, pipelining the layers. None of them splits the **sequence**: each rank still runs
# every token of its sample through its layers and keeps their activations for backward.
# Activations grow linearly with the sequence length S (with a fused attention kernel; the
# plain S x S score matrix grows with S²). At 128k tokens, one Llama-3.1-8B layer's saved
# activations alone are several GB, whatever the other axes do.
#
# Context parallelism (CP) cuts the sequence: with CP degree p, each rank holds S/p tokens.
# Almost every layer is per-token (norms, MLP, projections), so it needs nothing from other
# ranks. Attention is the exception: every query needs every earlier key. Ring attention
# brings the keys to the queries, one slice at a time, and never builds the whole sequence
# anywhere.

# %% [markdown]
# ## The merge: attention over two key sets from their parts
#
# Softmax attention for one query over keys split into blocks A and B:
#
# $$o = \frac{\sum_{j\in A} e^{s_j} v_j + \sum_{j\in B} e^{s_j} v_j}{\sum_{j\in A} e^{s_j} + \sum_{j\in B} e^{s_j}}$$
#
# Compute each block alone: its normalised output $o_A$ and its log-sum-exp
# $\ell_A = \log \sum_{j\in A} e^{s_j}$. Then $\sum_{j\in A} e^{s_j} v_j = e^{\ell_A} o_A$, and
# with $\ell = \log(e^{\ell_A} + e^{\ell_B})$ (`torch.logaddexp`):
#
# $$o = e^{\ell_A - \ell}\, o_A + e^{\ell_B - \ell}\, o_B$$
#
# The two weights sum to one, and every exponent is at most zero, so nothing overflows. This
# is the rule flash attention uses inside one GPU, and ring attention uses across GPUs. Here
# it is, the code the ring runs:

# %%
print(inspect.getsource(cw.attention_block))
print(inspect.getsource(cw.merge))

# %% [markdown]
# Check it in one process: attention over 64 keys, as two blocks of 32, merged.

# %%
q, k, v, _ = cw.make_qkv(seq_len=64)
scale = 1 / math.sqrt(q.shape[-1])
out_a, lse_a = cw.attention_block(q, k[:, :32], v[:, :32], scale, diagonal=False)
out_b, lse_b = cw.attention_block(q, k[:, 32:], v[:, 32:], scale, diagonal=False)
merged, _ = cw.merge(out_a, lse_a, out_b, lse_b)
full = cw.full_attention(q, k, v, causal=False)
merge_error = (merged - full).abs().max().item()
print(f"max |merged - full attention| = {merge_error:.1e}")
assert merge_error < 1e-6

# %% [markdown]
# ## The ring, by hand
#
# Each of p ranks holds its queries, keys and values. At step t, rank r holds the key/value
# slice of rank r - t: it computes the attention of its queries to that slice and merges it in.
# Before it computes, it posts the slice's trip to rank r + 1 and the next slice's arrival
# from r - 1 (`batch_isend_irecv`, both directions together), and it waits for them only
# after the compute: the traffic travels while the rank works. After p steps every query has
# seen every key; after p - 1 rotations, the traffic
# is (p-1)/p of the sequence's keys and values per rank per layer, the same volume as an
# all-gather, but only two slices are ever in memory at once.
#
# ```
#  step 0:  rank0[KV0]  rank1[KV1]  rank2[KV2]  rank3[KV3]
#  step 1:  rank0[KV3]  rank1[KV0]  rank2[KV1]  rank3[KV2]     each slice moves one rank on
#  step 2:  rank0[KV2]  rank1[KV3]  rank2[KV0]  rank3[KV1]
#  step 3:  rank0[KV1]  rank1[KV2]  rank2[KV3]  rank3[KV0]     every rank has seen all four
# ```
#
# The backward pass runs the same ring. Each rank keeps only its own q, k, v, output and
# log-sum-exp. With the final log-sum-exp, a block's probabilities are its exact share of the
# softmax, so each block's gradient can be computed alone. The key/value slice travels with
# its gradient accumulator: every rank adds its queries' share, and after p rotations the
# accumulator is home, complete. The backward cannot post its rotation early: the
# accumulator is complete only once this step has added to it, so it rotates after the
# compute, blocking.

# %%
print(inspect.getsource(cw.ring_attention_forward))
print(inspect.getsource(cw.ring_attention_backward))

# %% [markdown]
# Run it on 2 and 4 processes, causal, with both ways of cutting the sequence (next section).
# One spawn per ring size measures everything this lesson shows: parity, work per rank,
# memory per rank. The reference is plain attention on the whole sequence in this process.

# %%
PARITY_SEQ = 64
WORK_SHAPE = (4096, 4, 64)  # seq_len, heads, head_dim: enough compute for the CPU clock to see
MEMORY_SEQS = [1024, 2048, 4096]
rings = {p: run_workers(cw.lesson_measurements, p, PARITY_SEQ, WORK_SHAPE, MEMORY_SEQS, p == 2,
                        timeout_s=240)
         for p in (2, 4)}

# %%
q, k, v, dout = cw.make_qkv(PARITY_SEQ)
q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
reference = cw.full_attention(q, k, v, causal=True)
reference.backward(dout)
expected = {"out": reference.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
worst = 0.0
for p, ranks in rings.items():
    for layout in ("contiguous", "zigzag"):
        diffs = {name: (cw.unshard_sequence([r["parity"][layout][name] for r in ranks], layout)
                        - full).abs().max().item()
                 for name, full in expected.items()}
        worst = max(worst, *diffs.values())
        print(f"p={p} {layout:>10}: " + "  ".join(f"{n} {d:.1e}" for n, d in diffs.items()))
print(f"largest difference from one process: {worst:.1e}")
assert worst < 1e-5

# %% [markdown]
# Outputs and all three gradients match one process to about 1e-6, float32 rounding: the
# blocks are summed in a different order than one big softmax sums them.

# %% [markdown]
# The order the forward ran in, as it recorded it: every rotation posted before the compute
# that uses the same slice, and received after it.

# %%
events = rings[4][0]["traffic"]["ring_events"]  # rank 0's forward on 4 ranks
print(" -> ".join(f"{what} {step}" for what, step in events))
for step in range(3):  # each rotation is posted before its step computes, received after
    assert (events.index(("posted", step)) < events.index(("computed", step))
            < events.index(("received", step)))


# %% [markdown]
# ## Causal masking, and the work it leaves uneven
#
# With causal attention a query sees only earlier keys. Cut the sequence naively, rank r holds
# chunk r: rank 0's queries see only their own chunk, rank p-1's see all p chunks. The ring
# skips the blocks that are entirely in the future, so rank 0 finishes early and waits while
# rank p-1 computes: the step takes as long as the busiest rank.
#
# The head-tail split (zig-zag) cuts the sequence in 2p chunks and gives rank r chunks r and
# 2p-1-r: one early, one late. Every rank then computes the same number of blocks. The picture
# shows which query/key blocks each rank computes at p = 4 (white: skipped, in the future).

# %%
def block_owner_grid(world_size, layout):
    """grid[q_chunk][k_chunk] = the rank that computes that block (-1: skipped)."""
    n = cw.num_chunks(world_size, layout)
    grid = torch.full((n, n), -1)
    for rank in range(world_size):
        for q_id in cw.chunk_ids(rank, world_size, layout):
            for k_id in range(n):
                if cw.visible(q_id, k_id, causal=True):
                    grid[q_id, k_id] = rank
    return grid


fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
cmap = plt.get_cmap("tab10").copy()
for ax, layout in zip(axes, ("contiguous", "zigzag")):
    grid = block_owner_grid(4, layout).float()
    shown = torch.where(grid < 0, torch.nan, grid)
    ax.imshow(shown, cmap=cmap, vmin=0, vmax=9)
    n = grid.shape[0]
    for i in range(n):
        for j in range(n):
            if grid[i, j] >= 0:
                ax.text(j, i, f"r{int(grid[i, j])}", ha="center", va="center", fontsize=11,
                        color="white")
    ax.set_title(f"{layout}: {n} chunks", fontsize=12)
    ax.set_xlabel("key chunk", fontsize=11)
    ax.set_ylabel("query chunk", fontsize=11)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
fig.suptitle("Causal attention at p = 4: which rank computes each block", fontsize=13)
fig.tight_layout()
plt.show()

# %% [markdown]
# Count the blocks. Contiguous: rank r computes r + 1 blocks of (S/p)² (its diagonal block is
# computed whole and masked, as here). Zig-zag: every rank computes (r + 1) + (2p - r) = 2p + 1
# blocks of (S/2p)², that is (2p + 1)/4 of the large ones. At p = 4: contiguous 1, 2, 3, 4
# (the busiest rank does 1.6 x the mean); zig-zag 2.25 for everyone.
#
# The ring counted the blocks it computed and timed them with each thread's CPU clock (the
# 4 processes share 2 cores here, so wall time would mostly measure waiting for a core), in
# one run each.

# %%
def predicted_blocks(rank, world_size, layout):
    """Blocks of this layout's chunk size that rank computes in one causal forward."""
    if layout == "contiguous":
        return rank + 1
    return 2 * world_size + 1


work_rows = []
for p, ranks in rings.items():
    for layout in ("contiguous", "zigzag"):
        blocks = [r["work"][layout]["blocks"] for r in ranks]
        cpu = [r["work"][layout]["cpu_s"] for r in ranks]
        # forward and backward each compute every visible block once
        predicted = [2 * predicted_blocks(rank, p, layout) for rank in range(p)]
        assert blocks == predicted, (p, layout, blocks, predicted)
        work_rows.append((p, layout, blocks, cpu, max(cpu) / (sum(cpu) / p)))
        print(f"p={p} {layout:>10}: blocks per rank {blocks}, CPU s per rank "
              f"{[round(c, 3) for c in cpu]}, busiest / mean {max(cpu) / (sum(cpu) / p):.2f}")

# %% [markdown]
# Those ring figures move from run to run: 4 processes share 2 cores here, and their memory
# bandwidth, so what a block costs depends on what the other ranks run at the same moment (one
# run here had rank 3 below rank 2). To see each rank's share on its own, replay it: this
# process computes exactly the blocks each rank computes, on one thread, with the ranks taking
# turns for five rounds so that a slow moment of the machine falls on all of them alike.

# %%
print(inspect.getsource(cw.rank_blocks_cpu_s))
replay = {layout: cw.replay_ring_work(4, *WORK_SHAPE, layout) for layout in ("contiguous", "zigzag")}
imbalance = {layout: max(cpu) / (sum(cpu) / 4) for layout, cpu in replay.items()}
ring_imbalance = {layout: ratio for p, layout, _, _, ratio in work_rows if p == 4}

fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
for ax, (layout, cpu) in zip(axes, replay.items()):
    ax.bar(range(4), cpu, color="tab:blue")
    ax.axhline(sum(cpu) / 4, color="black", linestyle="--", linewidth=1, label="mean")
    ax.set_title(f"{layout}: busiest / mean = {imbalance[layout]:.2f}", fontsize=12)
    ax.set_xlabel("rank", fontsize=11)
    ax.set_xticks(range(4))
    ax.legend(fontsize=10)
axes[0].set_ylabel("attention CPU seconds", fontsize=11)
fig.suptitle(f"Causal ring attention, p = 4, S = {WORK_SHAPE[0]}: each rank's blocks, replayed",
             fontsize=13)
fig.tight_layout()
plt.show()

for layout in replay:
    print(f"{layout:>10}: busiest / mean replayed {imbalance[layout]:.2f}, "
          f"on the ring {ring_imbalance[layout]:.2f}")
print(f"blocks predict: contiguous {2 * 4 / (4 + 1):.2f}, zigzag 1.00")
assert imbalance["contiguous"] > 1.3, "the naive split should leave the last rank busiest"
assert imbalance["zigzag"] < 1.15, "the head-tail split should even the work out"

# %% [markdown]
# Zig-zag is close to even. Contiguous is clearly uneven, but less than the block count's
# 1.6. The blocks do not all cost the same: a diagonal block also builds its causal mask and
# fills it in. Time one block of each kind here (1024 tokens, the contiguous chunk at p = 4),
# and put those costs on the block counts: rank r computes two diagonal blocks (forward and
# backward) and 2r full ones.

# %%
diagonal_s, full_s = cw.block_costs(WORK_SHAPE[0] // 4, *WORK_SHAPE[1:])
modelled = [2 * diagonal_s + 2 * rank * full_s for rank in range(4)]
modelled_ratio = max(modelled) / (sum(modelled) / 4)
print(f"one diagonal block {diagonal_s * 1e3:.0f} ms, one full block {full_s * 1e3:.0f} ms "
      f"({diagonal_s / full_s:.2f}x)")
print(f"busiest / mean predicted from those costs: {modelled_ratio:.2f} "
      f"(block counts alone: 1.60; replayed: {imbalance['contiguous']:.2f})")
assert diagonal_s > full_s and modelled_ratio < 1.6
zig_total, contiguous_total = sum(replay["zigzag"]), sum(replay["contiguous"])
print(f"total attention CPU seconds at p = 4: contiguous {contiguous_total:.2f}, "
      f"zigzag {zig_total:.2f}")
assert zig_total < contiguous_total

# %% [markdown]
# With the diagonal block's extra cost, every rank carries the same fixed amount, which pulls
# the ratio from 1.6 toward 1: the two unit costs predict a ratio below 1.6, as replayed. Both
# come from a timer on a shared machine, so the prediction is printed next to the replay
# rather than asserted equal to it. On GPUs
# the diagonal block is cheaper instead: a causal kernel skips its masked half, so there the
# contiguous imbalance grows towards (p - 1/2)/(p/2) = 1.75 at p = 4.
#
# The totals differ too, though both layouts compute about the same number of scores. The
# zig-zag blocks are a quarter the size (512 x 512 scores per head instead of 1024 x 1024):
# the mask, exp and softmax-backward passes over a block are memory-bound, and here they cost
# less per element on the smaller block. Flash attention tiles for the same reason.
#
# torch's `context_parallel` applies the head-tail split by default (`_HeadTailLoadBalancer` in
# `torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py`).

# %% [markdown]
# ## Memory per rank against sequence length
#
# What does a rank keep for backward? Only its own q, k, v, output (each heads x S/p x
# head_dim) and log-sum-exp (heads x S/p): the visiting slices and the score blocks are freed
# as the ring moves on. So the saved bytes are (4·head_dim + 1)·heads·(S/p)·4, exactly 1/p of
# what one process would save with the same kernel. Measured with autograd's
# saved-tensor hooks, which see every tensor saved for backward:

# %%
print(inspect.getsource(cw.saved_bytes))

# %%
heads, head_dim = 4, 16  # ring_memory's shape


def predicted_saved_bytes(seq_len, world_size):
    return (4 * head_dim + 1) * heads * (seq_len // world_size) * 4


memory = {1: {}}
for seq_len in MEMORY_SEQS:  # p = 1: the same ring code in this process, a ring of one
    local = [t.requires_grad_() for t in cw.make_qkv(seq_len, heads, head_dim)[:3]]
    memory[1][seq_len] = cw.saved_bytes(lambda: cw.ring_attention(*local, layout="zigzag"))
for p, ranks in rings.items():
    per_rank = [r["memory"] for r in ranks]
    assert all(m == per_rank[0] for m in per_rank), "every rank saves the same"
    memory[p] = per_rank[0]
plain = {}
for seq_len in MEMORY_SEQS:  # plain attention keeps the S x S probabilities too
    local = [t.requires_grad_() for t in cw.make_qkv(seq_len, heads, head_dim)[:3]]
    plain[seq_len] = cw.saved_bytes(lambda: cw.full_attention(*local))

print("saved for backward, MiB per rank")
print(f"{'S':>6} | {'plain':>8} | " + " | ".join(f"ring p={p}" for p in memory))
for seq_len in MEMORY_SEQS:
    print(f"{seq_len:>6} | {plain[seq_len] / 2**20:8.2f} | " + " | ".join(
        f"{memory[p][seq_len] / 2**20:8.3f}" for p in memory))
    for p in memory:
        assert memory[p][seq_len] == predicted_saved_bytes(seq_len, p), (p, seq_len)

# %%
fig, ax = plt.subplots(figsize=(7, 3.6))
for p in memory:
    ax.plot(MEMORY_SEQS, [memory[p][s] / 2**20 for s in MEMORY_SEQS], marker="o",
            label=f"ring attention, p = {p}")
ax.plot(MEMORY_SEQS, [plain[s] / 2**20 for s in MEMORY_SEQS], marker="s", color="gray",
        linestyle="--", label="plain attention (S x S scores), one process")
ax.set_xscale("log", base=2)
ax.set_yscale("log", base=2)
ax.set_xlabel("sequence length S", fontsize=11)
ax.set_ylabel("MiB saved for backward, per rank", fontsize=11)
ax.set_title("Attention activations per rank: linear in S, divided by p", fontsize=12)
ax.legend(fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# Each doubling of S doubles a rank's bytes; each doubling of p halves them, exactly as
# predicted (asserted above, byte for byte). Plain attention's line is steeper: it keeps
# the S x S probabilities, 4x per doubling. Ring attention never forms them, the same saving
# flash attention makes inside one GPU.
#
# In a whole model the per-token layers (MLP, norms, projections) divide by p too, since each
# rank runs them on its S/p tokens. What does not divide: the parameters (shard them with
# FSDP over the same ranks, as torchtitan does with its `dp_shard_cp` mesh axis) and the
# two key/value slices in flight.

# %% [markdown]
# ## The other way: all-to-all (Ulysses)
#
# The ring moves keys and values to the queries. DeepSpeed-Ulysses moves the work instead:
# an all-to-all re-cuts q, k and v from "every head, S/p tokens" to "H/p heads, every token",
# each rank runs plain attention on its heads, and one more all-to-all cuts the output back by
# sequence. Four all-to-alls per layer, each sending (p-1)/p of a rank's slice.
#
# Per rank and forward, with s the bytes of one of q, k, v on one rank: the ring sends
# 2(p-1)s (p-1 key/value slices), the all-to-all 4(p-1)s/p. Counted with lesson 00's byte
# counter in the same runs, on a 1,024-token sequence:

# %%
print(inspect.getsource(cw.sequence_to_heads))
print(inspect.getsource(cw.ulysses_attention))

# %%
q, k, v, _ = cw.make_qkv(1024)  # lesson_measurements' traffic_seq, 4 heads of 16
reference = cw.full_attention(q, k, v, causal=True)
for p, ranks in rings.items():
    out = cw.unshard_sequence([r["traffic"]["ulysses_out"] for r in ranks], "contiguous")
    slice_bytes = ranks[0]["traffic"]["slice_bytes"]  # one of q, k, v on one rank
    predicted = {"ring": 2 * (p - 1) * slice_bytes, "all-to-all": 4 * (p - 1) / p * slice_bytes}
    sent = ranks[0]["traffic"]["sent"]
    print(f"p={p}: all-to-all output vs one process {(out - reference).abs().max():.1e} | "
          + " | ".join(f"{name} sent {sent[name]:,} B, predicted {predicted[name]:,.0f}"
                       for name in predicted if sent[name] is not None))
    assert (out - reference).abs().max() < 1e-5
    for name in predicted:  # within 2%: the rest is message headers
        if sent[name] is not None:
            assert abs(sent[name] / predicted[name] - 1) < 0.02, (name, sent[name])

# %% [markdown]
# At p = 2 they send the same; beyond that the all-to-all sends 2/p of the ring's bytes. So
# Ulysses wins where the all-to-all is fast, inside a node with NVLink, and where p divides
# the number of heads (it cannot cut 8 heads 16 ways; grouped-query attention, with fewer
# key/value heads, caps it lower). The ring wins when p is larger than that, across nodes
# where each rank only talks to its neighbours, and when a block's compute is long enough to
# hide its traffic. Large runs combine them: Ulysses inside a node, the ring across nodes.

# %% [markdown]
# ## The library path: context_parallel in torch
#
# torch ships CP as a prototype: inside `with context_parallel(mesh, buffers=[...],
# buffer_seq_dims=[...])`, the buffers are sharded along the sequence (head-tail by default)
# and `F.scaled_dot_product_attention` is replaced by a ring version. Which attention kernels
# does the ring version handle? The installed torch says:

# %%
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention  # noqa: E402

supported = sorted(str(op) for op in cp_attention.custom_ops)
print("\n".join(supported))
assert all("_for_cpu" not in op for op in supported)

# %% [markdown]
# Flash, memory-efficient and cuDNN attention: CUDA kernels, all of them. On a CPU,
# `scaled_dot_product_attention` runs `aten._scaled_dot_product_flash_attention_for_cpu`,
# which is not in that table. Here is what `context_parallel` did in the 2-process run above:

# %%
library = [r["library"] for r in rings[2]]
print(library[0])
assert not library[0]["ran"], "context_parallel ran on CPU: update this lesson"
assert "_scaled_dot_product_flash_attention_for_cpu" in library[0]["error"]

# %% [markdown]
# So on this machine the library path fails with that `NotImplementedError` (DTensor has no
# sharding rule for the CPU kernel), and the by-hand ring is the only CP that runs. On GPUs
# the same call is what torchtitan uses (`--parallelism.context_parallel_degree`). **GPU only,
# not executed in CI**: `context_parallel` over NCCL, with the worker
# `try_library_context_parallel` in `lessons/context_workers.py` changed to a CUDA mesh and
# tensors; it returns its parity against one process's SDPA.

# %% [markdown]
# ## In a whole model: lab07
#
# The lab trains the course's model with this ring in every attention layer, composed with
# FSDP2: a ("dp", "cp") mesh gives the ring its groups, and `fully_shard` runs over all ranks,
# so each gradient is averaged over every token of the global batch. Two things change
# outside attention: inputs and targets are cut with the same layout, and RoPE rotates each
# token by its *global* position. Its `--check-parity` compares every parameter with one
# process training whole sequences:
#
# ```bash
# torchrun --standalone --nproc-per-node 4 labs/lab07_context_parallel.py --cp 2 --check-parity
# ```

# %% [markdown]
# ## Summary
#
# - CP cuts the sequence: each rank keeps S/p tokens' activations. Attention is the only
#   layer that needs the other ranks, and the ring brings it their keys and values.
# - The log-sum-exp merge makes attention over a union of key sets from its parts, exactly.
# - Ring attention by hand, forward and backward, matches one process to about 1e-6 at p = 2
#   and 4.
# - Causal masking with a contiguous split leaves the last rank with p blocks and the first
#   with one; the head-tail split evens them out (measured: the busiest/mean ratio above,
#   and the diagonal block's measured extra cost explains why contiguous lands below the
#   block count's 1.6).
# - Saved activations per rank are exactly 1/p (measured byte for byte at three lengths).
# - torch's `context_parallel` handles the CUDA attention kernels only; on a CPU it raises.
#
# ## Exercises
#
# - **Graded:** ring attention by hand. Fill in `exercises/ring.py`, then run
#   `python exercises/grade.py ring`: it checks your code against one process, check by check
#   ([the exercises](../exercises/README.md)).
#
# Each exercise below is checked: it has a self-check (a Python block your answer must pass)
# and a worked answer, collapsed, in [the exercise book](../docs/onboarding-exercises.md).
#
# 1. **The causal work of each rank**: the attention blocks each rank computes under the
#    contiguous and the zig-zag split
#    ([onboarding exercise 7.1](../docs/onboarding-exercises.md#exercise-71-the-causal-work-of-each-rank)).
# 2. **The bytes a ring sends**: what one rank sends in ring attention's forward and backward
#    ([onboarding exercise 7.2](../docs/onboarding-exercises.md#exercise-72-the-bytes-a-ring-sends)).
#
# ## If it breaks
#
# - A rank stops in `rotate`: one rank skipped a step of the ring, so its neighbour's
#   `irecv` waits for ever (here, until the group's timeout). Every rank must run every step,
#   even one with no visible block ([hangs and timeouts](../runbooks/collective-timeout.md)).
# - Parity off by far more than 1e-5: the chunk layout used to shard differs from the one
#   used to unshard, or the causal test compares chunk ids of different layouts.
