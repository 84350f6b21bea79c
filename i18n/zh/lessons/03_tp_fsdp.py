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
# # 03 · 节点内用张量并行，跨节点用 FSDP
#
# 学完本课，你将能够：
#
# - 用数字说明为什么张量并行（TP）应该放在节点内部的高速链路上，而 FSDP 负责跨节点；
# - 手动把一个 MLP 先按列并行、再按行并行切分，并在前向和反向上与 `nn.Linear` 逐一对照；
# - 读懂 2D `("dp", "tp")` 设备网格上 DTensor 的放置方式，说出每个 rank（进程编号）持有什么；
# - 为每个 Transformer block 编写 TP 计划（`ColwiseParallel`、`RowwiseParallel`、`SequenceParallel`、`PrepareModuleInput`、loss parallel），在 `fully_shard` 之前应用它，并校验计划中的键；
# - 根据 Megatron-LM 的分析预测一步里会出现哪些集合通信，再用 `CommDebugMode` 验证；
# - 为真实集群规划布局：8 个节点 x 8 块 GPU、tp = 4，对应的网格是 (16, 4)。
#
# 所有代码都能在笔记本电脑的 CPU 上通过 gloo 运行；换到 GPU 上，同样的代码走 NCCL。

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

import lab03_tp_fsdp as lab  # noqa: E402  （可以直接导入：导入时什么都不执行）
import tp_workers  # noqa: E402  （worker 函数放在模块里：spawn 会重新导入它们）
from labkit.loop import learning_rate  # noqa: E402  （各实验的预热调度）
from spawn import launch_lab, run_workers  # noqa: E402

# %% [markdown]
# ## 为什么
#
# FSDP 对参数、梯度和优化器状态做了分片，但每个 rank 仍然要在自己的微批次上跑完整的层，所以**激活值**并没有分片。序列一长，激活值就成了显存的大头。张量并行（TP）把每一层的矩阵乘法分到 t 个 rank 上，所以每个 rank 只保存大部分激活值的一个切片；*序列并行*（SP）与 TP 配合使用，还把各个 norm 和残差流沿序列维切开，这部分激活值也随之缩小为 1/t。
#
# Korthikanti 等人（arXiv:2205.05198，表 2）统计了一个 Transformer 层为反向传播保存的激活值字节数（激活值为 16 位，不做重计算），记序列长度为 s、微批次大小为 b、隐藏维度为 h、注意力头数为 a、TP 并行度为 t：
#
# | 布局 | 每层字节数 |
# |---|---|
# | 不用 TP | s b h (34 + 5 a s / h) |
# | TP | s b h (10 + 24 / t + 5 a s / (h t)) |
# | TP + 序列并行 | s b h (34 / t + 5 a s / (h t)) |
#
# 其中 5 a s / h 这几项是存下来的 s x s 注意力分数，FlashAttention 并不保存它们（第 02 课算过两者的差别：t = 1 时约 485 GiB 对 85 GiB）；34 这一项假设的是标准多头注意力和 4h 的 GELU MLP。所以对 Llama 而言，下面的数字是偏高的估计，但 TP 和 SP 各自能除掉哪些部分并不变。
#
# 以 Llama-2-70B 规模的层（h = 8192，a = 64，共 80 层）为例，取 s = 4096、b = 1：

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
assert activation_gib(1, False) > 80  # 仅激活值就超过一整张 80 GB 的 GPU
assert activation_gib(8, True) < activation_gib(8, False) < activation_gib(1, False) / 5

# %% [markdown]
# TP 的代价是*每一层内部*都要通信：（按下文的统计）每层、每个微批次，前向要对一个 (s, b, h) 的激活值做两次 all-reduce，反向再做两次。环形 all-reduce 让每个 rank 传输张量大小的 2 (t - 1) / t 倍。
#
# 下面的链路速度只是用于说明的假设值（厂商标称的量级，并非在这里实测）：同一节点内 GPU 之间每个方向约 450 GB/s（NVLink 级别），跨节点每块 GPU 约 50 GB/s（一块 400 Gb/s 网卡）。

# %%
t = 8
tensor_bytes = s * b * h * 2  # 一份 bf16 激活值
tp_bytes_per_rank = num_layers * 4 * 2 * (t - 1) / t * tensor_bytes
links = {"inside a node (~450 GB/s)": 450e9, "across nodes (~50 GB/s)": 50e9}
for link, bytes_per_s in links.items():
    print(f"TP traffic per micro-batch: {tp_bytes_per_rank / 1e9:.1f} GB -> "
          f"{tp_bytes_per_rank / bytes_per_s * 1e3:.0f} ms {link}")
assert tp_bytes_per_rank / 50e9 > 5 * tp_bytes_per_rank / 450e9

# %% [markdown]
# 每个微批次几十 GB，而且压在每一层的关键路径上：节点内不到十分之一秒，跨节点则要大半秒，每个微批次都是如此。
#
# FSDP 的通信量也不小：t = 8 时，在*每个*微批次的前向中，每个 rank 仍要 all-gather 它的 TP 切片，即 bf16 权重的 1/8（70e9 x 2 B / 8，约 17.5 GB），反向中再来一次（梯度累积省不掉这些），每步还要对梯度做一次 reduce-scatter。但层内没有任何计算要等它：当前 block 计算时，下一个 block 的 all-gather 可以同时进行（在 GPU 上走单独的 stream；第 06 课会讲它如何做到）。TP 的 all-reduce 则夹在同一层的两次矩阵乘法之间，没有任何办法把它藏住。所以要用 2D 布局：**节点内用 TP，走高速链路；跨节点用 FSDP。**
#
# ## 从零开始：先列并行，再行并行
#
# Megatron-LM（Shoeybi 等人，arXiv:1909.08053）这样切分 MLP `y = gelu(x A) B`，使前向和反向各只需一次集合通信：`A` 按输出特征切分（列并行：每个 rank 计算一部分隐藏单元，gelu 又是逐元素运算，所以中间无需交换数据），`B` 按输入特征切分（行并行：每个 rank 得到 y 的一个*部分和*）。
#
# 前向对部分和做 all-reduce（即 Megatron 的 `g`）；反向对输入梯度做 all-reduce（即 `f`），因为每个 rank 的切片只贡献了 dL/dx 的一部分。在代码里，`A` 是 `fc1.weight.T`：`nn.Linear` 按 (out, in) 存储权重，所以切分 A 的列就是切分 `fc1.weight` 的行，切分 B 的行就是切分 `fc2.weight` 的列。下图画的是实际存储的权重，对应后文 2 个 rank 的例子（8 个输入，16 个隐藏单元）：

# %%
fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), gridspec_kw={"width_ratios": [1, 2]})
rank_colors = ["tab:blue", "tab:orange"]
for r in range(2):  # fc1.weight（即 A 的转置），16 x 8：rank r 保留输出行 8r .. 8r+7
    axes[0].add_patch(plt.Rectangle((0, 8 * r), 8, 8, color=rank_colors[r], alpha=0.75))
    axes[0].text(4, 8 * r + 4, f"rank {r}\nrows {8 * r}-{8 * r + 7}", ha="center", va="center",
                 fontsize=11, color="white", fontweight="bold")
    # fc2.weight（即 B 的转置），8 x 16：rank r 保留输入列 8r .. 8r+7（同一批隐藏单元）
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
# `tp_workers.py` 把 `f` 和 `g` 实现为 autograd 函数，并在两个进程上把切分后的 MLP 与 `nn.Linear` 对照检查。全部代码如下：

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
    assert r["a_shape"] == r["b_shape"] == (8, 8)  # 每个 rank 各占 16 个隐藏单元的一半
    assert max(r["out_diff"], r["x_grad_diff"], r["a_grad_diff"], r["b_grad_diff"]) < 1e-6

# %% [markdown]
# 两者在舍入误差内相等（fp32 下约 1e-7）：差异来自求和顺序，而不是数学上的不同。
#
# ## 让 DTensor 的放置方式看得见
#
# PyTorch 用 DTensor 表达这些布局：一个张量，加上一个设备网格，再加上网格每个轴上的一种*放置方式*（`Replicate()`、`Shard(dim)`，或表示尚未求和的 `Partial()`）。
#
# 下面把一个 4x4 张量（值为 0..15）以四种方式放到由 4 个 rank 组成的 2D 网格 `("dp", "tp") = (2, 2)` 上。（这一节和后面两个 4 rank 的演示共用同一组 4 个进程，每一节读取各自那部分结果。）

# %%
tour = run_workers(tp_workers.tour_2d, 4, timeout_s=240)
placed = [r["placements"] for r in tour]
for layout in placed[0]["local"]:
    print(layout)
    for rank, r in enumerate(placed):
        print(f"  rank {rank} at (dp, tp) = {tuple(r['coordinate'])}: {r['local'][layout]}")
two_d = [r["local"]["(Shard(0), Shard(1))"] for r in placed]
assert two_d[3] == [[10.0, 11.0], [14.0, 15.0]]  # rank 3 = (dp 1, tp 1)：右下角那块
replicated = [r["local"]["(Replicate(), Replicate())"] for r in placed]
assert all(local == replicated[0] for local in replicated)  # 每个 rank 都持有全部 16 个值

# %% [markdown]
# ## 使用 PyTorch：实验中的计划
#
# `labs/lab03_tp_fsdp.py` **逐个 Transformer block**应用 Megatron 计划，计划里的键都相对于 block 来写；嵌入层和输出投影之后再单独处理。下面是实验构建出的计划（分别为不带和带序列并行）：

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
# 有几点值得注意，实验代码里都有注释说明：
#
# - **注意力头。** 对 `wq/wk/wv` 使用 `ColwiseParallel` 后，每个 rank 分到 `num_heads / tp` 个头。实验中的 `Attention` 根据投影宽度推断头数（`view(bsz, seq, -1,
#   head_dim)`），所以不用改任何模块属性；`inspect_tp_fsdp` 会断言本地宽度。
# - 在 `attention` 和 `feed_forward` 上使用 **`PrepareModuleInput(..., use_local_output=False)`**：`PrepareModuleInput` 把模块的输入转成 DTensor，布局按计划的要求来；`use_local_output=False` 让模块拿到的就是这个 DTensor，而不是它的本地张量。于是三个投影共享同一个 DTensor 输入，反向时它们的输入梯度以 DTensor 的形式相加，all-reduce（Megatron 的 `f`）只做**一次**，而不是每个投影各做一次。
# - **序列并行。** block 与 block 之间的激活值是 `Shard(1)`（按序列维切分）；归一化层只处理本地的 token；进入注意力/MLP 时做 all-gather，离开时做 reduce-scatter。
# - **损失并行。** 不开它，输出投影会在每个 TP rank 上把完整的 logits（batch x seq x vocab）gather 回来再算损失。开了 `--loss-parallel`，logits 按词表保持分片（`Shard(-1)`），由 `loss_parallel()` 直接在分片上算交叉熵：各 rank 之间只对每个 token 的几个数做 all-reduce（最大值、指数和、目标 token 的 logit），logits 本身从不传输。
# - **顺序。** 先应用 TP，再在 `"dp"` 子网格上对每个 block 和根模块调用 `fully_shard`。
#
# 下图把“序列并行”那一条画成一个 block，布局与这份计划一致。`PrepareModuleInput` 在序列进入注意力和 MLP 时对它做 all-gather；行并行的 `wo` 和 `w2` 把部分和直接 reduce-scatter 回 `Shard(1)`。反向正好镜像过来：all-gather 的梯度是 reduce-scatter，反之亦然。

# %%
fig, ax = plt.subplots(figsize=(12, 3.4))
seq_color, tp_color = "tab:green", "tab:blue"
boxes = [  # （左边的 x、宽度、文字、颜色）：一个 block 的前向，从左到右
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
for x0, x1, label in arrows:  # （起点 x、终点 x、这条边上的集合通信）
    ax.annotate("", xy=(x1, 2.0), xytext=(x0, 2.0), arrowprops={"arrowstyle": "->", "lw": 1.5})
    ax.text((x0 + x1) / 2, 2.1, label, ha="center", va="bottom", fontsize=9, color="tab:red")
for x in (10.5, 20.3):  # 残差相加：两个操作数都是 Shard(1)
    ax.plot(x, 2.0, "o", markersize=18, markerfacecolor="white", markeredgecolor="black")
    ax.text(x, 2.0, "+", ha="center", va="center", fontsize=12)
    ax.text(x, 1.1, "(b, s/t, h)", ha="center", va="center", fontsize=9, color="dimgray")
for x0, x1 in [(0.5, 10.5), (11.1, 20.3)]:  # 残差流绕过每个子层
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
    assert sp_plan[sublayer].input_layouts == (Shard(1),)  # 进入时按序列分片……
    assert sp_plan[sublayer].desired_input_layouts == (Replicate(),)  # ……再做 all-gather
    assert sp_plan[row_parallel].output_layouts == (Shard(1),)  # 部分和经 reduce-scatter 输出
assert {type(sp_plan[norm]).__name__ for norm in ("attention_norm", "ffn_norm")} == {
    "SequenceParallel"}

# %% [markdown]
# 这些断言直接从实验的计划里读出上述布局；下文的[验证 Megatron-LM 的统计](#the-megatron-lm-count-checked)会在真实的一步里找到这两次 all-gather 和两次 reduce-scatter。
#
# 在 (2, 2) 网格上，每个权重最终都带有 2D 放置方式。下表列出 block 0 的参数在 rank 0（即 (dp, tp) = (0, 0)）上的样子。“sharded placements”列是每个网格轴上的放置方式，`"dp"` 在前。“sharded”列是两步之间的本地形状，也就是优化器实际更新的部分：每个做了 TP 的权重的四分之一。“tp-local”列是 FSDP 沿 `"dp"` 做完 all-gather（`unshard()`）之后的本地形状，即矩阵乘法用到的切片。
#
# `_StridedShard(dim=0, sf=2)` 标出 TP 和 FSDP 切分了同一维。`ColwiseParallel` 给每个 tp rank 分 wq 的 64 行中的 32 行，FSDP 的 `Shard(0)` 再沿 `"dp"` 把这 32 行切一次。于是 rank (dp d, tp t) 持有第 32 t + 16 d 到 32 t + 16 d + 15 行：dp 下标 0 持有第 0-15 行（在 tp rank 0 上）和第 32-47 行（在 tp rank 1 上），是跨步的，而不是在 `"dp"` 上用普通的 `Shard(0)` 会分到的第 0-31 行。`sf=2` 数的是先切出来的 tp 切片个数。

# %%
layout = [r["layout"] for r in tour]
print(f"{'parameter':26s} {'sharded placements':44s} {'sharded':>10s} {'tp-local':>10s}")
for name, row in layout[0]["params"].items():
    print(f"{name:26s} {row['placements']:44s} {str(row['sharded_local']):>10s} "
          f"{str(row['tp_local']):>10s}")
wq = layout[0]["params"]["attention.wq.weight"]
assert wq["global"] == (64, 64) and wq["tp_local"] == (32, 64) and wq["sharded_local"] == (16, 64)
assert layout[0]["params"]["attention_norm.weight"]["tp_placements"] == "-"  # 普通参数：没有做 TP

# %% [markdown]
# 所以沿 `"dp"` 的 all-gather（例如 rank 0 和 2，都是 tp rank 0）恰好还原出 tp rank 0 的第 0-31 行，即 tp 本地的 (32, 64)。`wo` 和 `w2` 不需要跨步：TP 切的是它们的第 1 维，FSDP 切的是第 0 维。
#
# 实验借助工具包中的 `clip_grad_norm_`（`labs/labkit/loop.py`）做梯度裁剪（`--clip`，默认 1.0）：每个 rank 先算自己那些梯度分片的范数，DTensor 的 `full_tensor()` 再沿每个网格轴对平方做 all-reduce，于是每个 rank 都按整个模型梯度的范数来裁剪。不用序列并行时，归一化层的权重不参与 TP，它们的梯度只在 `"dp"` 网格上，其余梯度在 `("dp", "tp")` 上；一次 `torch.stack` 不能混用不同的网格，所以实验先按网格分别求平方和，再合起来。
#
# ## 哪里会出错
#
# 在 4 个 rank 上演示四种错误：把 block 级的键交给根模型、先 FSDP 后 TP，以及两种错误的网格大小。

# %%
per_rank = [r["mistakes"] for r in tour]
mistakes = per_rank[0]
for key, value in mistakes.items():
    print(f"{key}: {value}")
small_mesh = [r["small_mesh_coordinate"] for r in per_rank]
print("coordinates in a (1, 2) mesh on 4 ranks:", small_mesh)
assert small_mesh[2] is None and small_mesh[3] is None  # rank 2 和 3 不在设备网格中
assert mistakes["root_plan_warnings"] and not mistakes["root_plan_wq_is_dtensor"]
assert "'attention.wq' matches no submodule of TinyLlama" in mistakes["guard"]
assert "Cannot distribute a DTensor" in mistakes["fsdp_then_tp"]
assert "Mesh should not be bigger than default world size" in mistakes["mesh_too_big"]

# %% [markdown]
# - 计划中的键匹配不到任何模块时，**只会触发一条警告**：`wq` 在每个 rank 上仍是一个普通的完整张量。实验中的 `check_plan_keys` 会在这种情况下抛出 `ValueError`，并指明是哪个键。
# - 先应用 FSDP 会失败：`fully_shard` 已经把权重变成了 `"dp"` 网格上的 DTensor，TP 无法再把它们重新分布到 `"tp"` 上。
# - 网格大于 world size 会报错；小于 world size 却**不会**：rank 2 和 3 拿到的坐标是 `None`。它们不在网格里，要么一直闲置，要么让第一个需要它们参与的集合通信卡死。
#
# ## 运行实验
#
# 四个 rank，三种网格形状 (dp, tp) = (4, 1)、(2, 2)、(1, 4)，每种分别不带和带序列并行。每次运行都让每个 rank 的微批次保持为 4 条序列（`--batch-size 4 x dp`），这样比出来的差别只来自 TP 切分掉的那部分。
#
# `--check-parity` 在单个进程中用相同的 batch 训练，并以 fp32 逐一比较每个参数（误差在 1e-5 以内）；`--count-comms` 用 `CommDebugMode` 测量第 1 步，并统计 autograd 为反向保存的字节数。
#
# <details><summary>这几次运行是怎么启动的</summary>
#
# 这些运行的 rank 都从一个已经导入过 torch 的服务进程 fork 出来（`lessons/spawn.py` 中的 `launch_lab`），每个 rank 拿到的环境变量和 torchrun 给的一样：效果等同于 `run_lab` 文档字符串里的那条 `torchrun` 命令，在 2 核笔记本上每次约省 10 s 启动时间。
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
# 在每种网格上，fp32 一致性都在 1e-5 以内。这要靠各实验的学习率预热，原因由[小结之前的那一节](#why-fp32-parity-needs-warmup-adamws-first-step)实测。
#
# ### 每个 rank 的显存占用与 tp 的关系
#
# TP 切分激活值，2-D 网格切分状态。预期：随着 tp 增大，每个 rank 的状态保持不变，激活值下降：

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
assert max(params) < 1.01 * min(params)  # 2D 分片：每种设备网格形状都是 4 等分
assert acts[0] > acts[1] > acts[2] and acts_sp[1] < acts[1] and acts_sp[2] < acts[2]

# %% [markdown]
# 不论网格形状如何，参数和优化器状态都分布在全部四个 rank 上，所以曲线是平的（唯一的微小例外是归一化层权重：无论用不用 SP，它们在 tp 轴上都是复制的）。保存的激活值随 tp 增大而减少，启用序列并行后减少得更多，因为序列并行还切分了归一化层和残差流。
#
# ### 每步通信量与 tp 的关系
#
# tp 增大时，FSDP 的通信量减少，TP 的通信量出现：FSDP 传的是权重和梯度，TP 传的是激活值，而且每一层都有。下图把每个 rank 一步发送的字节数按这两部分分开。
#
# <details><summary>字节数是怎么统计的</summary>
#
# `CommDebugMode` 会记下每个集合通信的名字。TP 的集合通信来自 DTensor（`c10d_functional.*`），FSDP 的来自 `fully_shard`（`c10d.*`），所以按名字就能把一步的通信量清清楚楚地分成两部分。
#
# 实验工具包中的 `CommCounter`（`labs/labkit/probes.py`，见它的 `__torch_dispatch__`）按第 00 课的环形系数统计每个 rank *发送*的字节数：对 n 个 rank 的组和 S 字节的完整张量，all-reduce 发送 2 (n-1)/n x S，all-gather 或 reduce-scatter 发送 (n-1)/n x S。
#
# 如果改为统计“集合通信经手的张量”，就会混用两种口径：DTensor 的函数式 all-gather 只看到本地分片（统计时乘以 n - 1），而 FSDP 的 all-gather 看到的是聚合后的输出。
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
# FSDP 的通信量随 tp 增大而减少（每个 dp rank 只需 all-gather 自己的 tp 本地切片，dp = 1 时则根本无需 all-gather）；TP 的通信量在 tp > 1 时立即出现，而且与激活值大小相当。tp = 1 时，TP 一侧仅剩的集合通信是梯度裁剪中梯度范数的归约（每步只有几个标量）。
#
# ### 验证 Megatron-LM 的统计
#
# 按每个 block 计，这一分析预测：不用 SP 时，前向两次 all-reduce（在 `wo` 和 `w2` 之后），反向两次（注意力和 MLP 之前的 `f`）；用 SP 时，每次 all-reduce 都变成一对 all-gather / reduce-scatter；另外每个归一化层还要为其权重梯度做一次小的 all-reduce，因为每个 rank 只看到了自己的 token，这个梯度只是部分和。

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
# 一次 all-reduce 的开销等于一次 reduce-scatter 加一次 all-gather（环形 all-reduce 本来就是这样实现的：2 (n-1)/n = (n-1)/n + (n-1)/n），所以序列并行发送的字节数与普通 TP 相同，却把普通 TP 整份保留的那些激活值也分片了。
#
# 实测下来，每步、每个 rank 上唯一的区别，是 SP 额外对每个归一化层的权重梯度做的 all-reduce（这里有 5 个归一化层，每个 64 个 fp32 值；一般为 `2 x num_layers + 1` 个）：

# %%
defaults = lab.parse_config(["--tp", "1"])  # 上面几次运行训练的模型
num_norms = 2 * defaults.num_layers + 1     # 每个 block 两个，外加最后一个
for t in (2, 4):
    tp_bytes = wire_mib(runs[t, False], "c10d_functional.") * 2**20
    sp_bytes = wire_mib(runs[t, True], "c10d_functional.") * 2**20
    norm_grads = num_norms * defaults.dim * 4 * 2 * (t - 1) / t  # 每个 norm 一次 all-reduce
    print(f"tp = {t}: TP {tp_bytes:,.0f} B, TP + SP {sp_bytes:,.0f} B "
          f"(difference {sp_bytes - tp_bytes:,.0f} B; norm weight grads {norm_grads:,.0f} B)")
    assert abs(sp_bytes - tp_bytes - norm_grads) <= 64  # 梯度范数用到的几个 4 字节标量
    assert abs(sp_bytes / tp_bytes - 1) < 0.01

# %% [markdown]
# ## 一个完整的集群规划示例
#
# 8 个节点 x 8 块 GPU = 64 个 rank，tp = 4。网格必须覆盖每一个 rank：dp = 64 / 4 = 16，所以写成 `init_device_mesh("cuda", (16, 4), mesh_dim_names=("dp", "tp"))`（实验用 `init_mesh` 构建同样的布局，它还会给每个轴都设上作业的超时时间）。
#
# 常见的错误是写成 `(8, 4)`：那只有 32 个 rank。网格大于 world size 会报错（见上文）；小于 world size 则会不声不响地把一部分 rank 晾在外面。
#
# 把 `"tp"` 放在最后一个轴，每个 TP 组就是 4 个连续的 rank；而 torchrun 给同一节点上的 rank 连续编号，所以 TP 永远不会跨节点：

# %%
nodes, gpus_per_node, tp = 8, 8, 4
world = nodes * gpus_per_node
mesh = torch.arange(world).reshape(world // tp, tp)  # 与 init_device_mesh 的排布相同
tp_groups, dp_groups = mesh.tolist(), mesh.t().tolist()
print(f"mesh {tuple(mesh.shape)}; TP group of rank 13: {tp_groups[13 // tp]}; "
      f"its dp group: {dp_groups[13 % tp]}")
assert tuple(mesh.shape) == (16, 4) and 8 * 4 != world
assert all(len({r // gpus_per_node for r in group}) == 1 for group in tp_groups)  # 每组一个节点
assert len({r // gpus_per_node for r in dp_groups[0]}) == nodes  # dp 组跨越所有节点

# %% [markdown]
# 计划要逐个 block 应用（`for block in model.layers.values(): parallelize_module(block,
# mesh["tp"], block_plan)`），绝不能拿 block 级的相对键在根模块上一次性应用：这些键在根模块上什么也匹配不到，而且如上所示，PyTorch 只会发出警告。
#
# ## fp32 一致性为什么需要预热：AdamW 的第一步
#
# 上面几次实验运行在 fp32 下与单进程的差距都在 1e-5 以内，这只是因为各实验让学习率从 0 开始预热。本节实测其中的原因（整门课程只在这里讲这个效应）。
#
# 任何并行运行的求和顺序都和单进程不同（TP 的半和、3 个 rank 上的 all-reduce），所以 fp32 结果的最后几位会不同，约为 1e-7。AdamW 的第一步会把它放大成一整步：这一步是 `lr * g / (|g| + eps)`，其中 eps = 1e-8；只要分量远大于 eps，不管它多大，这一步都约等于 `lr * sign(g)`。下面实测单个权重上的一次 AdamW 更新：

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
assert abs(first_adamw_step(1e-8) - 1.5e-3) < 1e-5      # g = eps：半步
assert abs(first_adamw_step(1e-12) - 3e-7) < 1e-9       # 远小于 eps：与 g 成正比

# %% [markdown]
# 所以一个 1e-7 的分量（可能只是舍入噪声）会让对应权重移动将近一整步，换一种求和顺序就可能翻转它的符号。各实验让学习率从 0 开始预热（`--warmup-steps 5`，大多数 Transformer 训练配方都这么做，实现在 `labkit.loop.learning_rate`）：第 1 步的学习率为 0，只用来填充 AdamW 的矩估计。设想一个权重：它第 1 步的梯度是舍入噪声，在一种求和顺序下是 +1e-7，换一种是 -1e-7；第 2 步的梯度才是真实的：

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
# 不预热时，噪声的符号在第 1 步就让两份副本相距 2 lr，第 2 步几乎缩小不了这个差距。预热时，第 1 步什么都不动；第 2 步除以两步梯度的 RMS，而它由真实梯度主导，两份副本始终贴在一起。下面换成实验本身，在网格 (1, 2) 上各跑 3 步，比较有无预热、fp32 与 float64：

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
# 不预热时，有少数参数相差约 1e-4，而损失值一致；换成 float64，同一个程序一致到约 1e-13，所以 fp32 下的差距是 AdamW 放大了的舍入误差，不是 bug。加上预热后，fp32 一致性回到约 1e-7。你自己的一致性检查如果只差一点没通过，用 `--parity-dtype float64` 来判断：两种 dtype 下都有差距，是 bug；只在 fp32 下有差距，是舍入误差。
#
# ## 小结
#
# - TP 把一个 block 里的每个矩阵乘法切分到 TP 组的各个 rank 上：权重*和*激活值都会变小，代价是每一层内部都有集合通信，所以要把 TP 放在节点内的高速链路上。
# - 先列并行再行并行，每半个 block 在前向和反向各需要一次 all-reduce；序列并行把每次 all-reduce 变成一对 all-gather / reduce-scatter，同时还切分了归一化层和残差流。
# - 构建顺序：先建 2D 网格 `("dp", "tp")`，在 `mesh["tp"]` 上逐个 block 调用 `parallelize_module`，然后在 `mesh["dp"]` 上对每个 block 和根模块调用 `fully_shard`。一定要校验计划中的键：拼写错误只会触发警告。
# - TP 在数学上是精确的，但不是逐位一致的。AdamW 的第一步会让每个梯度远大于 eps 的权重移动约 `lr * sign(grad)`，所以要让学习率从 0 开始预热：这样第 1 步什么都不动，fp32 一致性回到约 1e-7（断言要求低于 1e-6）。`--parity-dtype float64` 可以区分 bug 与舍入误差。
#
# ## 练习
#
# - **带评分：** 手写列并行和行并行层，集合通信全部自己写。填写 `exercises/tp.py`，然后运行 `python exercises/grade.py tp`：评分脚本会逐项把你的代码与单进程的结果对比（[练习](../exercises/README.md)）。
#
# 下面每道练习都收在[入门练习](../docs/onboarding-exercises.md)里，配有一段自查代码（你的答案必须通过的一段 Python）和一份折叠起来的参考答案。
#
# 1. **规划集群布局**：64 张 GPU、TP 为 4 时的 `(dp, tp)` 设备网格，以及某个 rank 在其中所属的组（[入门练习](../docs/onboarding-exercises.md#exercise-31-lay-out-a-cluster)中的练习 3.1）。
# 2. **手写列并行 + 行并行**：张量并行 MLP 的各个部分和，以及把它们合起来的那一次集合通信（[入门练习](../docs/onboarding-exercises.md#exercise-32-column-parallel-then-row-parallel-by-hand)中的练习 3.2）。
# 3. **损失并行省下了什么**：logits 的 all-gather 要发送多少字节，以及 `--loss-parallel` 改为发送什么（[入门练习](../docs/onboarding-exercises.md#exercise-33-what-loss-parallel-saves)中的练习 3.3）。
#
# ## 出问题时
#
# - 加上 TP 后显存不足：见[显存不足的缓解手段](../runbooks/oom-mitigations.md)。
# - 某个 rank 卡在集合通信里（常见原因是网格没有覆盖每个 rank，或各 rank 的计划不一致）：见[集合通信超时](../runbooks/collective-timeout.md)、[某个 rank 卡住或变慢](../runbooks/stuck-rank.md)。
# - 启动阶段卡死：见[启动时卡死](../runbooks/startup-hang.md)；其他问题：见[排障手册索引](../runbooks/index.md)。
