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
# # 07 · 上下文并行：用环形注意力处理长序列
#
# 学完本课，你将能够：
#
# - 说清为什么长序列需要单独的一个并行维度：其他各个维度都会让每个 rank 持有*整条*序列的激活值；
# - 用 log-sum-exp 规则合并两个部分注意力的结果，并推导出这条规则；
# - 在 2 个和 4 个进程上手动运行环形注意力（Ring Attention，前向和反向），并证明它的输出和梯度与单进程一致，误差在 1e-6 量级；
# - 看到朴素切分下因果掩码造成的负载不均衡，测量它，再用首尾切分（zig-zag）消除它；
# - 测量每个 rank 的激活值内存随序列长度的变化：它按 CP 并行度等比例缩小；
# - 说出 torch 自带的 `context_parallel` 做了什么，以及它为什么不能在 CPU 上运行。
#
# 全部内容都在笔记本电脑的 CPU 上通过 gloo 运行。已在 torch 2.13 上测试。

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

import context_workers as cw  # noqa: E402  （worker 函数放在模块里：spawn 会重新导入它们）
from spawn import run_workers  # noqa: E402

torch.set_num_threads(1)  # 与下面的 worker 一样，每个进程只用一个线程

# %% [markdown]
# ## 为什么
#
# 数据并行切分 batch，FSDP 切分参数，张量并行切分权重矩阵，流水线并行切分层。它们都不切分**序列**：每个 rank 仍要让样本的每个 token 流经自己负责的各层，并为反向传播保存这些 token 的激活值。激活值随序列长度 S 线性增长（使用融合注意力 kernel 时如此；朴素的 S x S 分数矩阵则按 S² 增长）。在 128k 个 token 时，仅 Llama-3.1-8B 一层保存的激活值就有好几 GB，其他并行维度怎么切都无济于事。
#
# 上下文并行（CP）切分的是序列：CP 并行度为 p 时，每个 rank 持有 S/p 个 token。几乎所有层都是逐 token 计算的（归一化、MLP、各种投影），不需要其他 rank 的任何数据。注意力是例外：每个 query 都需要它之前的所有 key。环形注意力把 key 一片一片地送到 query 所在的 rank，任何地方都不会拼出完整的序列。

# %% [markdown]
# ## 合并：由两组 key 各自的结果得到整体注意力
#
# 对一个 query 做 softmax 注意力，key 被分成 A、B 两块：
#
# $$o = \frac{\sum_{j\in A} e^{s_j} v_j + \sum_{j\in B} e^{s_j} v_j}{\sum_{j\in A} e^{s_j} + \sum_{j\in B} e^{s_j}}$$
#
# 先对每块单独算出归一化后的输出 $o_A$ 和 log-sum-exp $\ell_A = \log \sum_{j\in A} e^{s_j}$。于是 $\sum_{j\in A} e^{s_j} v_j = e^{\ell_A} o_A$；再令 $\ell = \log(e^{\ell_A} + e^{\ell_B})$（即 `torch.logaddexp`），得到：
#
# $$o = e^{\ell_A - \ell}\, o_A + e^{\ell_B - \ell}\, o_B$$
#
# 两个权重之和为 1，而且每个指数都不大于零，所以不会溢出。flash attention 在单块 GPU 内部用的就是这条规则，环形注意力则把它用在 GPU 之间。下面就是环上实际运行的代码：

# %%
print(inspect.getsource(cw.attention_block))
print(inspect.getsource(cw.merge))

# %% [markdown]
# 先在单进程里验证：对 64 个 key 做注意力，分成两块、每块 32 个，再合并。

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
# ## 手写环形注意力
#
# p 个 rank 各自持有自己的 query、key 和 value。在第 t 步，rank r 持有 rank r - t 的 key/value 切片：它计算自己的 query 对这个切片的注意力并合并进结果。在计算之前，它先提交两个方向的通信：把这个切片发给 rank r + 1，并接收 rank r - 1 的下一个切片（`batch_isend_irecv`，收、发一起提交）；计算完成之后才等待它们完成。这样，通信与计算同时进行。p 步之后，每个 query 都见过了所有 key；经过 p - 1 次轮转，每个 rank 每层的通信量是整条序列 key 和 value 的 (p-1)/p，与一次 all-gather 相同，但内存里任何时刻都只有两个切片。
#
# ```
#  step 0:  rank0[KV0]  rank1[KV1]  rank2[KV2]  rank3[KV3]
#  step 1:  rank0[KV3]  rank1[KV0]  rank2[KV1]  rank3[KV2]     each slice moves one rank on
#  step 2:  rank0[KV2]  rank1[KV3]  rank2[KV0]  rank3[KV1]
#  step 3:  rank0[KV1]  rank1[KV2]  rank2[KV3]  rank3[KV0]     every rank has seen all four
# ```
#
# 反向传播跑的是同一个环。每个 rank 只保存自己的 q、k、v、输出和 log-sum-exp。有了最终的 log-sum-exp，一个块的概率就是它在整个 softmax 中的准确份额，所以每个块的梯度都能单独计算。key/value 切片带着它的梯度缓冲区一起传递：每个 rank 把自己 query 贡献的那一份加进去，p 次轮转之后，缓冲区回到原来的 rank，梯度也就完整了。反向传播不能提前提交轮转：缓冲区要等这一步加完才完整，所以它在计算之后才轮转，而且是阻塞的。

# %%
print(inspect.getsource(cw.ring_attention_forward))
print(inspect.getsource(cw.ring_attention_backward))

# %% [markdown]
# 在 2 个和 4 个进程上运行它，使用因果掩码，并分别用两种序列切分方式（见下一节）。每种环大小只 spawn 一次，就测出本课展示的全部内容：一致性、每个 rank 的计算量、每个 rank 的内存。参考结果是在本进程中对整条序列做的普通注意力。

# %%
PARITY_SEQ = 64
WORK_SHAPE = (4096, 4, 64)  # seq_len、heads、head_dim：计算量足够让 CPU 计时测得出来
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
# 输出和三个梯度与单进程一致，误差约 1e-6，来自 float32 舍入：各块求和的顺序与一次大 softmax 的求和顺序不同。

# %% [markdown]
# 前向传播自己记录下的执行顺序：每次轮转都在使用同一切片的计算之前提交，在计算之后才收到。

# %%
events = rings[4][0]["traffic"]["ring_events"]  # 4 个 rank 时 rank 0 的前向
print(" -> ".join(f"{what} {step}" for what, step in events))
for step in range(3):  # 每次轮转都在该步计算之前发出、计算之后接收
    assert (events.index(("posted", step)) < events.index(("computed", step))
            < events.index(("received", step)))

# %% [markdown]
# ## 因果掩码，以及它造成的计算量不均
#
# 在因果注意力中，一个 query 只能看到它之前的 key。如果朴素地切分序列，让 rank r 持有第 r 段：rank 0 的 query 只能看到自己这一段，rank p-1 的 query 则能看到全部 p 段。环会跳过完全处于“未来”的块，于是 rank 0 很早就算完，只能等 rank p-1 算完：一步的耗时取决于最忙的那个 rank。
#
# 首尾切分（zig-zag）把序列切成 2p 段，把第 r 段和第 2p-1-r 段分给 rank r：一段靠前，一段靠后。这样每个 rank 计算的块数都相同。下图显示 p = 4 时每个 rank 计算哪些 query/key 块（白色：位于未来，被跳过）。

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
# 数一数块数。连续切分：rank r 计算 r + 1 个 (S/p)² 大小的块（它的对角块整块计算后再加掩码，这里的实现就是如此）。首尾切分：每个 rank 都计算 (r + 1) + (2p - r) = 2p + 1 个 (S/2p)² 大小的块，相当于 (2p + 1)/4 个大块。p = 4 时：连续切分为 1、2、3、4（最忙的 rank 是平均值的 1.6 x）；首尾切分每个 rank 都是 2.25。
#
# 环在运行时统计了自己计算的块数，并用每个线程的 CPU 时钟计时（这里 4 个进程共享 2 个核，按实际耗时测，得到的主要是等待 CPU 核的时间）；每个数字都只来自一次运行。

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
        # 前向和反向各把每个可见块算一次
        predicted = [2 * predicted_blocks(rank, p, layout) for rank in range(p)]
        assert blocks == predicted, (p, layout, blocks, predicted)
        work_rows.append((p, layout, blocks, cpu, max(cpu) / (sum(cpu) / p)))
        print(f"p={p} {layout:>10}: blocks per rank {blocks}, CPU s per rank "
              f"{[round(c, 3) for c in cpu]}, busiest / mean {max(cpu) / (sum(cpu) / p):.2f}")

# %% [markdown]
# 环上测得的这些数字每次运行都不一样：这里 4 个进程共享 2 个核，也共享内存带宽，所以一个块的开销取决于其他 rank 同一时刻在跑什么（这里有一次运行中 rank 3 的数字甚至比 rank 2 还低）。要单独看每个 rank 的份额，就把它回放一遍：本进程在一个线程上把每个 rank 要算的块原样算一遍，各 rank 轮流执行，共五轮，这样机器某一时刻变慢，影响会均匀地落到所有 rank 上。

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
# 首尾切分接近均衡。连续切分明显不均衡，但不到块数推算出的 1.6。各个块的开销并不相同：对角块还要构造因果掩码并做填充。下面分别给两种块计时（1024 个 token，即 p = 4 时连续切分的一段），再把这些开销代入块数：rank r 计算两个对角块（前向、反向各一个）和 2r 个完整块。

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
# 对角块的额外开销让每个 rank 都背上同样一份固定开销，这会把比值从 1.6 往 1 拉：用这两个单位开销预测的比值低于 1.6，与回放结果一致。两者都来自共享机器上的计时，所以预测值只是打印在回放结果旁边，而不去断言两者相等。在 GPU 上情况相反，对角块反而更便宜：因果 kernel 会跳过被掩码的那一半，所以在 GPU 上，连续切分的不均衡会增大，趋向 (p - 1/2)/(p/2)，p = 4 时为 1.75。
#
# 两种切分的总耗时也不同，尽管它们计算的分数个数大致相同。首尾切分的块只有四分之一大（每个 head 512 x 512 个分数，而不是 1024 x 1024）：对一个块做掩码、exp 和 softmax 反向这几遍都受限于访存，在这台机器上，块越小，每个元素的开销越低。flash attention 做分块（tiling）也是出于同样的原因。
#
# torch 的 `context_parallel` 默认使用首尾切分（见 `torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py` 中的 `_HeadTailLoadBalancer`）。

# %% [markdown]
# ## 每个 rank 的内存随序列长度的变化
#
# 一个 rank 要为反向传播保存什么？只有它自己的 q、k、v、输出（形状都是 heads x S/p x head_dim）和 log-sum-exp（heads x S/p）：来访的切片和分数块会随着环的推进而释放。所以保存的字节数是 (4·head_dim + 1)·heads·(S/p)·4，恰好是单进程用同一个 kernel 时的 1/p。下面用 autograd 的 saved-tensor hooks 来测量，它能看到为反向传播保存的每一个张量：

# %%
print(inspect.getsource(cw.saved_bytes))

# %%
heads, head_dim = 4, 16  # 与 ring_memory 的形状相同


def predicted_saved_bytes(seq_len, world_size):
    return (4 * head_dim + 1) * heads * (seq_len // world_size) * 4


memory = {1: {}}
for seq_len in MEMORY_SEQS:  # p = 1：在本进程里跑同一份环代码，环上只有一个 rank
    local = [t.requires_grad_() for t in cw.make_qkv(seq_len, heads, head_dim)[:3]]
    memory[1][seq_len] = cw.saved_bytes(lambda: cw.ring_attention(*local, layout="zigzag"))
for p, ranks in rings.items():
    per_rank = [r["memory"] for r in ranks]
    assert all(m == per_rank[0] for m in per_rank), "every rank saves the same"
    memory[p] = per_rank[0]
plain = {}
for seq_len in MEMORY_SEQS:  # 普通 attention 还要保存 S x S 的概率矩阵
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
# S 每翻一倍，一个 rank 的字节数就翻一倍；p 每翻一倍，字节数就减半，与预测完全一致（上面已逐字节断言）。普通注意力的曲线更陡：它还要保存 S x S 的概率矩阵，S 每翻一倍增长 4x。环形注意力从不构造这个矩阵，这和 flash attention 在单块 GPU 内部省下的是同一笔内存。
#
# 在完整模型中，逐 token 的层（MLP、归一化、投影）的激活值同样除以 p，因为每个 rank 只在自己的 S/p 个 token 上运行它们。不会除以 p 的部分：参数（用 FSDP 在同一组 rank 上对它们分片，torchtitan 就是通过 `dp_shard_cp` 这个网格轴这样做的），以及正在传输中的两个 key/value 切片。

# %% [markdown]
# ## 另一种做法：all-to-all（Ulysses）
#
# 环形注意力把 key 和 value 送到 query 那里。DeepSpeed-Ulysses 则是把计算挪走：一次 all-to-all 把 q、k、v 从“全部注意力头、S/p 个 token”重新切成“H/p 个头、全部 token”，每个 rank 对自己的头做普通的注意力计算，再用一次 all-to-all 按序列切回去。每层四次 all-to-all，每次发送一个 rank 切片的 (p-1)/p。
#
# 记 s 为一个 rank 上 q、k、v 之一的字节数，则每个 rank 每次前向传播：环形发送 2(p-1)s（p-1 个 key/value 切片），all-to-all 发送 4(p-1)s/p。下面在同样的几次运行里，用第 00 课的字节计数器统计一条 1,024 个 token 的序列：

# %%
print(inspect.getsource(cw.sequence_to_heads))
print(inspect.getsource(cw.ulysses_attention))

# %%
q, k, v, _ = cw.make_qkv(1024)  # 即 lesson_measurements 的 traffic_seq，4 个头，每个 16 维
reference = cw.full_attention(q, k, v, causal=True)
for p, ranks in rings.items():
    out = cw.unshard_sequence([r["traffic"]["ulysses_out"] for r in ranks], "contiguous")
    slice_bytes = ranks[0]["traffic"]["slice_bytes"]  # 一个 rank 上 q、k、v 中的一个
    predicted = {"ring": 2 * (p - 1) * slice_bytes, "all-to-all": 4 * (p - 1) / p * slice_bytes}
    sent = ranks[0]["traffic"]["sent"]
    print(f"p={p}: all-to-all output vs one process {(out - reference).abs().max():.1e} | "
          + " | ".join(f"{name} sent {sent[name]:,} B, predicted {predicted[name]:,.0f}"
                       for name in predicted if sent[name] is not None))
    assert (out - reference).abs().max() < 1e-5
    for name in predicted:  # 误差在 2% 以内：多出的是消息头
        if sent[name] is not None:
            assert abs(sent[name] / predicted[name] - 1) < 0.02, (name, sent[name])

# %% [markdown]
# p = 2 时两者发送的字节数相同；p 更大时，all-to-all 只发送环形的 2/p。所以 Ulysses 适合 all-to-all 快的场合，比如节点内有 NVLink 的情况，而且 p 要能整除注意力头数（8 个头没法切成 16 份；分组查询注意力的 key/value 头更少，上限更低）。以下情况则是环形更有优势：p 超出这个范围；跨节点时，环上每个 rank 只和相邻 rank 通信；单个块的计算时间足够长，能把通信藏住。大规模训练会把两者结合起来：节点内用 Ulysses，节点间用环形。

# %% [markdown]
# ## 库的做法：torch 中的 context_parallel
#
# torch 以原型功能的形式提供 CP：在 `with context_parallel(mesh, buffers=[...],
# buffer_seq_dims=[...])` 内部，这些 buffer 会沿序列维度分片（默认使用首尾切分），`F.scaled_dot_product_attention` 则被替换成环形版本。环形版本支持哪些注意力 kernel？看已安装的 torch 怎么说：

# %%
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention  # noqa: E402

supported = sorted(str(op) for op in cp_attention.custom_ops)
print("\n".join(supported))
assert all("_for_cpu" not in op for op in supported)

# %% [markdown]
# Flash、memory-efficient 和 cuDNN 注意力：全都是 CUDA kernel。在 CPU 上，`scaled_dot_product_attention` 运行的是 `aten._scaled_dot_product_flash_attention_for_cpu`，它不在这张表里。下面是 `context_parallel` 在上面那次 2 进程运行中的实际结果：

# %%
library = [r["library"] for r in rings[2]]
print(library[0])
assert not library[0]["ran"], "context_parallel ran on CPU: update this lesson"
assert "_scaled_dot_product_flash_attention_for_cpu" in library[0]["error"]

# %% [markdown]
# 所以在这台机器上，走库的路子会失败，抛出上面那个 `NotImplementedError`（DTensor 没有针对这个 CPU kernel 的分片规则），手写的环是唯一能运行的 CP。在 GPU 上，torchtitan 用的正是同一个调用（`--parallelism.context_parallel_degree`）。**仅限 GPU，CI 中不执行**：在 NCCL 上运行 `context_parallel`，需要把 `lessons/context_workers.py` 中的 worker 函数 `try_library_context_parallel` 改为使用 CUDA 网格和 CUDA 张量；它返回的是与单进程 SDPA 对比的一致性。

# %% [markdown]
# ## 放进完整模型：lab07
#
# 本实验训练课程中的模型，在每个注意力层中都使用这个环，并与 FSDP2 组合：一个 ("dp", "cp") 网格为环提供进程组，`fully_shard` 则覆盖所有 rank，所以每个梯度都是在全局 batch 的所有 token 上求平均。注意力之外有两处变化：输入和目标按同样的布局切分；RoPE 按每个 token 的*全局*位置做旋转。实验的 `--check-parity` 会把每个参数与单进程训练完整序列的结果做比较：
#
# ```bash
# torchrun --standalone --nproc-per-node 4 labs/lab07_context_parallel.py --cp 2 --check-parity
# ```

# %% [markdown]
# ## 小结
#
# - CP 切分序列：每个 rank 只保存 S/p 个 token 的激活值。注意力是唯一需要其他 rank 数据的层，环把其他 rank 的 key 和 value 送过来。
# - 用 log-sum-exp 合并，可以由各部分的结果精确算出对多组 key 合起来的注意力。
# - 手写的环形注意力（前向和反向）在 p = 2 和 4 时与单进程一致，误差约 1e-6。
# - 因果掩码加上连续切分，会让最后一个 rank 计算 p 个块，而第一个 rank 只算一个；首尾切分把它们拉平（实测：见上面的最忙 rank / 平均值之比；实测得到的对角块额外开销，解释了为什么连续切分的比值低于块数推算的 1.6）。
# - 每个 rank 保存的激活值恰好是 1/p（在三种长度下逐字节测量）。
# - torch 的 `context_parallel` 只支持 CUDA 注意力 kernel；在 CPU 上会抛出异常。
#
# ## 练习
#
# - **带评分：** 手写环形注意力。填写 `exercises/ring.py`，然后运行 `python exercises/grade.py ring`：评分脚本会逐项把你的代码与单进程的结果对比（[练习](../exercises/README.md)）。
#
# 下面每道练习都收在[入门练习](../docs/onboarding-exercises.md)里，配有一段自查代码（你的答案必须通过的一段 Python）和一份折叠起来的参考答案。
#
# 1. **每个 rank 的因果计算量**：连续切分和首尾切分下，每个 rank 计算的注意力块数（[入门练习](../docs/onboarding-exercises.md#exercise-71-the-causal-work-of-each-rank)中的练习 7.1）。
# 2. **环形通信发送的字节数**：环形注意力的前向和反向中，一个 rank 发送的字节数（[入门练习](../docs/onboarding-exercises.md#exercise-72-the-bytes-a-ring-sends)中的练习 7.2）。
#
# ## 出问题时
#
# - 某个 rank 停在 `rotate` 里：有一个 rank 跳过了环的某一步，于是它邻居的 `irecv` 会一直等下去（这里是等到进程组超时）。每个 rank 都必须执行每一步，哪怕这一步没有可见的块（见[集合通信超时](../runbooks/collective-timeout.md)）。
# - 一致性偏差远大于 1e-5：分片时用的分段布局与还原时用的不一致，或者因果判断比较的是不同布局下的段编号。
