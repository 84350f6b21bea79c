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
# # 02 · FSDP2：看得见的分片，算得准的显存
#
# 学完本课，你将能够：
#
# - 算出 DDP、ZeRO-1、ZeRO-2 和 ZeRO-3/FSDP 下每个 rank 持有多少数据，并说出这个数字漏掉了什么；
# - 手动对一个层做分片（使用前 all-gather，梯度做 reduce-scatter），并证明 `fully_shard` 做的正是这些；
# - 在 meta 设备上构建模型，用 `fully_shard` 分片，再填充每个 rank 的分片；
# - 运行 `labs/lab02_fsdp.py`，并证明它训练出的模型与单进程训练的相同，误差在 1e-5 以内；
# - 把 FSDP1 代码迁移到 FSDP2，并识别网上流传的相关错误建议。
#
# 本课全部内容都在笔记本电脑的 CPU 上通过 gloo 运行。换到 GPU 上，同样的代码改用 NCCL。

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

import fsdp_workers  # noqa: E402  （worker 函数放在模块里：spawn 会重新导入它们）
import lab02_fsdp as lab  # noqa: E402  （实验可以直接导入：导入时什么都不执行）
import memory_estimator as est  # noqa: E402
from spawn import run_script, run_workers  # noqa: E402

# %% [markdown]
# ## 为什么
#
# DDP 在每个 rank 上都保留一份完整副本：参数、梯度和优化器状态。fp32 下使用 AdamW（每个参数两份状态），就是 4 + 4 + 8 = **每个参数 16 字节**，而且每个 rank 都是这么多，无论你加多少 rank。`labs/memory_estimator.py` 中的估算器针对四个 ZeRO 阶段做了这笔算术：

# %%
print(est.table(7_000_000_000, 8))
ddp_7b = est.estimate_per_rank(7e9, 8, "ddp").total_bytes
fsdp_7b = est.estimate_per_rank(7e9, 8, "fsdp").total_bytes
assert ddp_7b == 112e9 and fsdp_7b == 14e9   # 用 DDP 时，7B 装不进 80 GB 的 GPU

# %% [markdown]
# 7B 模型在 DDP 下每个 rank 需要 112 GB：还没存下任何激活值，就已经装不进 80 GB 的 GPU。分片到 8 个 rank 上（即 ZeRO-3，FSDP 实现的就是它）则只需 14 GB。
#
# 这就是 FSDP 的全部思路。下面先手写 FSDP，再用 `fully_shard` 实现并实测；最后回到[分片之后剩下的](#what-sharding-leaves-activations-and-the-gathered-unit)：激活值和未分片单元。
#
# 本课后面会用到这些词：
#
# - **ZeRO-1** 对优化器状态分片；参数和梯度在每个 rank 上仍是完整的。
# - **ZeRO-2** 再对梯度分片。
# - **ZeRO-3** 再对参数分片：FSDP 做的就是这个。
# - **单元**是一次 `fully_shard` 调用归成一组的参数（这里是一个 transformer block）：FSDP 在使用前一起 all-gather，用完后一起释放。
# - **根单元**（root）就是模型本身，最后由 `fully_shard(model)` 包装：它持有其余的参数（embedding、最终的 norm、输出层），并从前向开始一直保持 gather 状态，直到反向传播结束。

# %% [markdown]
# ## 从零开始：分片、all-gather、reduce-scatter
#
# FSDP 就是三个动作。每个 rank 只保存每个权重的一个切片（按行切，即 dim 0）。使用权重之前，先用一次 **all-gather** 把它重建出来，用完立即释放。反向传播之后，每个 rank 都有一份用自己的数据算出的完整大小的梯度；一次 **reduce-scatter** 把这些梯度在各 rank 之间求和，并只把每个 rank 负责的那些行交给它。随后优化器只更新本地分片。下面在 2 个进程上，先这样手动训练一个线性层，再用 `fully_shard` 训练，最后在一个进程里用整个全局 batch 训练。下面的 worker 函数（`lessons/fsdp_workers.py`）把这三种都做了一遍，其中第 (1) 部分就是手写的 FSDP。

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
# 数值在浮点舍入范围内一致：`fully_shard` 就是这三种集合通信，再加上调度。
#
# ### 逐个单元看一次 FSDP 训练步
#
# 在一个训练步中，每个 block 要 all-gather 两次（前向之前一次；反向之前再一次，而且提前一个 block 发出），每次用完就释放，它的反向一结束就做 reduce-scatter；根单元只 gather 一次，并一直保持完整。下图展示的是实验模型（两个 block 加根单元）在 2 个 gloo rank 上的情况。
#
# 这些色条来自 `torch.profiler`：FSDP2 用 `record_function` 给它执行的每个阶段打上标签（`FSDP::all_gather (layers.0)` 等）。`fsdp_workers.fsdp_step_trace` 记录一步，`fsdp_workers.step_phases` 把这些标签变成色条：

# %%
trace = run_workers(fsdp_workers.fsdp_step_trace, 2, timeout_s=180)[0]
bars = fsdp_workers.step_phases(trace["events"])  # [(单元, 阶段, 起始 ms, 结束 ms), ...]
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
assert frees == {"root": 0, "layers.0": 2, "layers.1": 2}  # 前向之后一次，反向之后一次

# %% [markdown]
# 从上往下看。每个 block 在前向之前先 all-gather，前向结束后立即释放（那条深色细条）；反向传播时再 all-gather 一次，而且 FSDP 会提前一个 block 发出这次 all-gather（`backward_prefetch`，浅蓝色）：layers.1 的 gather 在根单元的反向中发出（最先计算的是输出投影），layers.0 的 gather 则在 layers.1 的反向还没算时就已发出。每个 block 的反向传播一结束，它的梯度就立即做 reduce-scatter。根单元只 gather 一次：FSDP 让它从前向到反向传播一直保持完整，因为反向传播是从输出投影开始的。
#
# 这份 trace 展示的是顺序，不是重叠。FSDP2 以 `async_op=False` 发起 all-gather，靠单独的 CUDA stream 让它与计算并行，所以在 CPU 上训练线程要等完每一次 all-gather，各个色条首尾相接地排开（第 06 课会测量这一点，以及改用异步 all-gather 后有什么变化）。这份 trace 还暴露了 gloo 的一个细节：reduce-scatter 实际上是用 all-reduce 完成的（每个 `post_backward_reduce` 里都有一个 `gloo:all_reduce`）。
#
# <details><summary>这些 stream 在 torch 源码中的位置</summary>
#
# `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py` 中的 `all_gather_stream` 和 `reduce_scatter_stream`（torch 2.13）。仅限 GPU，这里没有测量。
# </details>
#
# ### 数一数 FSDP 的通信字节
#
# `CommCounter`（`labs/labkit/probes.py`）是实验工具包中的集合通信计数器：它记录训练步执行的每一次集合通信，以及本 rank 为它发送的字节数，按第 00 课的环形系数计算。上面跟踪的那一步就是在它之下运行的。下面与 DDP 对同样梯度做的 all-reduce 对比：

# %%
n, P, R = 2, trace["param_bytes"], trace["root_param_bytes"]
gathered = trace["wire_bytes"]["c10d._allgather_base_"]
scattered = trace["wire_bytes"]["c10d._reduce_scatter_base_"]
ddp_bytes = trace["ddp_wire_bytes"]
print(f"all-gathers {gathered:,} B + reduce-scatter {scattered:,} B = {gathered + scattered:,} B "
      f"sent per rank; DDP's all-reduce {ddp_bytes:,.0f} B; ratio {(gathered + scattered) / ddp_bytes:.3f}")
# 各 block 被 gather 两次（前向、反向），根模块一次；每个梯度 scatter 一次。
assert gathered == (n - 1) / n * (2 * (P - R) + R) and scattered == (n - 1) / n * P
assert abs((gathered + scattered) / ddp_bytes - (1.5 - R / (2 * P))) < 1e-9

# %% [markdown]
# 所以 FSDP 发送的字节数是 DDP 的 1.5 倍，再减去根单元份额的一半（根单元只 gather 一次）：这里是 1.47 倍。这些计数按环形算法（NCCL）计算；在 CPU 上，gloo 用基于 all-reduce 的方式实现 reduce-scatter，发送得更多。换来的是只需 1/N 的显存。
#
# ## 使用 PyTorch：fully_shard
#
# 实验脚本先在 **meta 设备**上构建模型（只有形状，不占内存），然后分片，最后才分配存储：每个 rank 只分配自己的分片，别的一概不分配。每个 transformer block 是一个单元（前向之前一次 all-gather，反向之前再一次，外加一次 reduce-scatter，正如上面的 trace 所示）；最后对根模块的那次调用把剩下的参数归成一组：

# %%
print(inspect.getsource(lab.apply_fsdp))
print(inspect.getsource(lab.build_fsdp_model))

# %% [markdown]
# 按顺序：
#
# 1. 在 meta 设备上构建模型：只有形状，不占内存。
# 2. 先对每个 block、再对根模块调用 `fully_shard`（`apply_fsdp`）：每个参数都变成一个 DTensor 分片，仍在 meta 设备上。
# 3. `model.to_empty(...)`：每个 rank 只分配自己的分片，别的一概不分配，也不初始化。
# 4. 填充数值：`init_sharded_weights`（`labs/labkit/model.py`）把每个完整参数计算一次（与单进程抽取的值相同），然后复制本 rank 的切片。
#
# 第 4 步的代价是一个完整参数大小的临时内存，不需要任何通信；其他做法（用 `distribute_tensor` 从 rank 0 分发，或从 DCP 检查点加载分片）在它的 docstring 中有讨论。
#
# ### DeviceMesh：按轴排列的 rank
#
# `fully_shard` 接受一个 `mesh` 参数，即 `DeviceMesh`：把 rank 排成网格，每个轴对应一个进程组（也就是第 00 课的子组，由它替你创建）。4 个 rank 的一维网格就是包含全部 4 个 rank 的一个组，FSDP 在它上面分片。轴为 `("dp_replicate", "dp_shard")` 的 2 x 2 网格有行有列：FSDP 在一行之内分片，在各行之间复制（即下文的 HSDP，混合分片数据并行）；第 03 课则在第二个轴上放张量并行。rank r 位于第 r // 2 行、第 r % 2 列：

# %%
meshes = run_workers(fsdp_workers.mesh_axes, 4, timeout_s=120)
for r, m in enumerate(meshes):
    print(f"rank {r}: 1-D 'dp' group {m['dp']} | 2 x 2 at {m['coordinate']}: "
          f"'dp_shard' group {m['dp_shard']}, 'dp_replicate' group {m['dp_replicate']}")
for r, m in enumerate(meshes):
    assert m["dp"] == [0, 1, 2, 3] and tuple(m["coordinate"]) == (r // 2, r % 2)
    assert m["dp_shard"] == [2 * (r // 2), 2 * (r // 2) + 1]      # 它所在的行
    assert m["dp_replicate"] == [r % 2, r % 2 + 2]                # 它所在的列

# %% [markdown]
# `init_device_mesh` 用 `new_group` 创建每个轴的进程组，而在 torch 2.13 中它不会继承默认进程组的超时（在 gloo 上变成 30 分钟）。各实验用工具包中的 `init_mesh()` 构建网格，它会显式传入超时：见[集合通信超时](../runbooks/collective-timeout.md)。

# %% [markdown]
# ### 实测：每个 rank 持有的字节数
#
# `lessons/fsdp_workers.py` 针对每种策略，用实验脚本自己的函数构建模型，让优化器更新一次，然后把每个 rank 所持张量背后的存储加起来（实验工具包探针 `labs/labkit/probes.py` 中的 `measure_state_bytes`）。world size 分别取 1、2、4：

# %%
measured = {n: run_workers(fsdp_workers.measure_strategies, n, ("ddp", "zero3"), timeout_s=240)
            for n in (1, 2)}
measured[4] = run_workers(fsdp_workers.measure_strategies, 4, timeout_s=240)  # 另加 zero1、fsdp_no_reshard、hsdp
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
# FSDP 每个 rank 的状态等于 DDP 的除以 world size，而估算器与各 rank 实际持有的量相差在 5% 以内（多出的一点是 AdamW 的 `step` 计数器，每个参数张量一个 4 字节的标量）。这里看不到填充，因为这个模型的每个 dim 0 都能被 1、2、4 整除。不能整除时，FSDP2 会把每个分片填充到 `ceil(dim0 / N)` 行，于是每个 rank 都按最大的分片分配；给估算器传入 `shapes=` 即可把这部分算进去：

# %%
odd = [(50257, 4096), (3, 4096)]   # GPT-2 大小的词表，以及一个比 N 还小的张量
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
# ### 并排比较 ZeRO 各阶段（world size 4）
#
# PyTorch 对阶段 1 和阶段 3 有原生工具：`ZeroRedundancyOptimizer`（阶段 1：优化器状态分片）和 `fully_shard`（阶段 3）。有两种不同的东西都被叫作“ZeRO-2”，所以本页给它们起了不同的名字：
#
# - 估算器中的 **`zero2`** 是经典的 ZeRO-2（DeepSpeed 的阶段 2）：梯度和优化器状态分片，每个 rank 始终持有一份完整参数。
# - 这里实测的 **`fsdp_no_reshard`** 是 `fully_shard(..., reshard_after_forward=False)`：两步之间，一切都像阶段 3 一样分片，但每个 block gather 出来的参数会从它的前向一直保留到它的反向传播，所以训练步进行中的峰值包含完整参数。
#
# 最后一列是前向与反向传播之间仍然存活的完整参数的字节数：

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
# 估算器的 "zero2" 就是经典的 ZeRO-2：每个 rank 始终持有完整参数。
assert est.estimate_per_rank(None, 4, "zero2", shapes=shapes).params_bytes == full_bytes
assert ws4[0]["zero3"]["unsharded_after_forward"] < 0.1 * full_bytes   # 只有根模块的参数
print("HSDP layout of layers.0.attention.wq.weight:", ws4[0]["hsdp"]["layout"])

# %% [markdown]
# ZeRO-1 以整个张量为单位在 rank 之间分配（按大小贪心分配），所以各 rank 的份额并不均匀；估算器的均匀切分是理想情况。`fsdp_no_reshard` 和 ZeRO-3 在两步之间持有的状态相同，区别在于训练步进行中有哪些数据存活。在阶段 3 下，前向之后仍保持 gather 状态的只有根单元的参数（embedding、最终的 norm、输出层：`fully_shard` 让根单元保持完整，因为反向传播从它开始）。
#
# ### 分片之后剩下的：激活值与未分片单元
#
# 分片把状态按 rank 数均分，但有两样东西分不掉，大模型能不能装下，恰恰取决于它们。
#
# 以 70B 模型、AdamW、64 个 rank 为例。总量为 16 B x 70e9 = 1120 GB；分片后每个 rank 1120 / 64 = **17.5 GB**（十进制单位；合 16.3 GiB）。
#
# <details><summary>你可能见过的“17.6 GB”</summary>
#
# 网上流传的一个算例给出同一模型每个 rank 17.6 GB。它是先把各项数字舍入、再相加得到的；精确的和是 17.5 GB。
# </details>

# %%
e70 = est.estimate_per_rank(70e9, 64, "zero3")
print(f"70B, AdamW, 64 ranks: params {e70.params_bytes / 1e9:.3f} GB + grads "
      f"{e70.grads_bytes / 1e9:.3f} GB + optimizer {e70.optimizer_bytes / 1e9:.2f} GB "
      f"= {e70.total_bytes / 1e9:.2f} GB per rank ({e70.total_bytes / 2**30:.2f} GiB)")
assert est.estimate_per_rank(70e9, 64, "ddp").total_bytes == 1120e9
assert e70.total_bytes == 17.5e9

# %% [markdown]
# 这个数字是下限，不是峰值：本课开头估算器的表格下面已经列出了它没有计入的内容。其中影响最大的是第一项：**激活值**。FSDP 分片的是状态，而不是计算，所以每个 rank 仍要为反向传播保留自己那个微批次的激活值。第 03 课会用 Korthikanti 等人的公式（arXiv:2205.05198，表 2）来计算激活值：在 16 位激活值、不做重计算的情况下，每层为 s b h (34 + 5 a s / h) 字节。以 Llama-2-70B（80 层，h = 8192，a = 64）为例，序列长度 4096、微批次大小 1 时：

# %%
s, b, h, a, num_layers = 4096, 1, 8192, 64, 80
activations_70b = num_layers * s * b * h * (34 + 5 * a * s / h)
print(f"activations: {activations_70b / 2**30:.0f} GiB per rank, against "
      f"{e70.total_bytes / 2**30:.1f} GiB of sharded state")
assert 480 < activations_70b / 2**30 < 490  # 约 485 GiB：约为表中所列状态的 30 倍
assert activations_70b > 25 * e70.total_bytes
# FlashAttention（SDPA 的融合 kernel）不存 s x s 的注意力分数：去掉 5 a s / h 这一项。
activations_70b_flash = num_layers * s * b * h * 34
print(f"without stored attention scores: {activations_70b_flash / 2**30:.0f} GiB per rank")
assert 80 < activations_70b_flash / 2**30 < 90 and activations_70b_flash > 5 * e70.total_bytes

# %% [markdown]
# 5 a s / h 这一项是注意力分数、softmax 输出和 dropout 掩码，每个头 s x s：这里占了 194 中的 160。FlashAttention（GPU 上 `scaled_dot_product_attention` 所用的实现）不存这些，反向时重算，剩下约 85 GiB，仍是状态的五倍。34 这一项假设的是标准多头注意力和带 dropout 的 4h GELU MLP；Llama 的分组查询注意力和 SwiGLU 会让它变动几个单位，但不改变结论。
#
# 所以训练 70B 模型还需要激活检查点（又称激活重计算：用重计算代替存储）、张量并行或序列并行（第 03 课），或者流水线阶段（第 04 课）。
#
# 下一项是*临时的未分片单元*：单元（通常是一个 transformer block）在计算时必须是完整的。一个 Llama-2-70B block（dim 8192，MLP 隐藏层 28672，8 个 128 维的 KV head）约有 0.86B 参数，bf16 下为 1.6 GiB；在预取下一个 block 期间，约为它的两倍：

# %%
dim, hidden, kv_dim = 8192, 28672, 8 * 128
block_params = 2 * dim * dim + 2 * dim * kv_dim + 3 * dim * hidden + 2 * dim
print(f"one block: {block_params / 1e9:.3f}B params = {2 * block_params / 2**30:.2f} GiB in bf16")
assert 0.85e9 < block_params < 0.86e9 and 1.55 < 2 * block_params / 2**30 < 1.65

# %% [markdown]
# ## 运行实验
#
# 实验脚本在 4 个进程上用 FSDP 训练，把每个参数与在相同全局 batch 上运行的单进程结果比较，并写出指标：

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
# 其他值得一试的选项（都由 `tests/test_lab02_fsdp.py` 覆盖）：`--hsdp 2`（2 个副本 x 2 个分片）、`--reshard-after-forward false`、`--grad-accum 2`（使用 `set_requires_gradient_sync(False)`）、`--mixed-precision bf16`、`--activation-checkpointing`、`--cpu-offload`、`--compile`，以及先用 `--checkpoint-dir` 加 `--stop-at-step` 运行，再换一个 world size 用 `--resume` 断点续训：DCP 在加载时会对检查点重新分片。
#
# ### 实测每个选项的代价
#
# 每个选项都是用一种代价换另一种：网络上传输的字节、为反向传播保留的激活值，或者时间。每个选项一行，2 个 rank，实验模型（`fsdp_workers.flag_matrix_row`）：每个 rank 在一步之后持有的字节数、每步发送的字节数、autograd 为反向传播保存的激活值、前向内部的 dtype（`layers.0.feed_forward.w1` 的权重和输出），以及第一步的耗时和之后五步耗时的中位数。
#
# 有两项在 CPU 上测不出有意义的东西。一是 `--cpu-offload` 这一行：状态本来就在主机内存里，没有东西可卸载，也没有复制到 GPU 的开销可计时。二是 `--compile` 的步耗时：模型这么小，Python 开销和 gloo 占了步耗时的大头，更快的 kernel 显不出来；这里只有它第一步的编译开销有意义。

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
assert all(r["state"] == base["state"] for r in rows.values())  # 分片的状态：始终是 fp32
assert gather["--mixed-precision bf16"] * 2 == gather["fp32 (default)"] == gather["--amp bf16 --mixed-precision fp32"]
assert all(r["wire_bytes"]["c10d._reduce_scatter_base_"] == base["wire_bytes"]["c10d._reduce_scatter_base_"]
           for r in rows.values())  # reduce_dtype 为 fp32：每一行里梯度都以 fp32 传输
assert rows["--amp bf16 --mixed-precision fp32"]["dtypes"] == {"weight": "float32", "activation": "bfloat16"}
assert rows["--mixed-precision bf16"]["dtypes"] == {"weight": "bfloat16", "activation": "bfloat16"}
assert rows["--activation-checkpointing"]["saved_activation_bytes"] < base["saved_activation_bytes"] / 5
assert rows["--compile"]["first_step_s"] > 5 * rows["--compile"]["step_s"]

# %% [markdown]
# 逐行解读这张表：
#
# - **`--amp bf16 --mixed-precision fp32`** 只开 autocast（加 `--mixed-precision fp32`，是因为这个策略的默认值 `auto` 会跟随 `--amp`），与 lab01 中一样：前向中权重仍是 fp32，每个 matmul 把输入转换成 bf16，所以*激活值*是 bf16（保存的字节更少），而 FSDP 仍然 all-gather fp32 权重：网络上传输的字节一点没少。
# - **`--mixed-precision bf16`** 是 FSDP 自己的 `MixedPrecisionPolicy(param_dtype=bfloat16,
#   reduce_dtype=float32)`：FSDP 在 all-gather *之前*就把每个分片转换成 bf16，所以 gather 传输的字节减半，block 也用 bf16 计算；梯度仍以 fp32 做 reduce-scatter，分片后的参数和 AdamW 状态也仍是 fp32。它不需要 autocast：在前向和反向传播中，参数本身就是 bf16。在 GPU 上这是实验的默认设置（`--mixed-precision auto` 跟随 `--amp`：GPU 支持 bf16 时用 bf16，不支持时用 fp16 加 GradScaler）；在 CPU 上默认仍是 fp32，以保证一致性。
# - **`--activation-checkpointing`** 只保留每个 block 的输入，其余的在反向传播中重新计算：保存的激活值字节数不到默认的五分之一（有断言），代价是每个 block 多做一次前向。重计算时，参数已经为反向传播 gather 好了，所以不会增加通信字节。
# - **`--cpu-offload`** 把分片状态和优化器的更新放在 CPU 上，每个单元 all-gather 时再把它复制到 GPU。在这台 CPU 上，这一行只能重复默认那一行的数字，也说明不了它在 GPU 上的代价。
# - **`--compile`**（inductor，逐 block 编译）把编译开销付在第一步：第一步的耗时超过稳定后一步的 5 倍（有断言）。它既不改变通信字节，也不改变保存的激活值；第 06 课会在计算占主导的场景下测量它的速度。
#
# 每一行持有的 fp32 状态都相同，reduce-scatter 的 fp32 梯度字节数也都相同（有断言）。其余的步耗时只打印、不断言。
#
# <details><summary>生成本页的那次运行中的数字</summary>
#
# 激活检查点让保存的字节数降到约 1/9。步耗时来自一台 2 核的 CPU 机器，模型这么小，Python 开销和 gloo 占了大头；在那台机器上，`--compile` 稳定后的步耗时几乎不变。
# </details>
#
# **HSDP 在各网格轴上的字节数。** 在 4 个 rank 上用 `--hsdp 2` 时，all-gather 和 reduce-scatter 都留在各自的分片组内（快速的节点内维度）；只有梯度*分片*的 all-reduce 会跨越复制维度：

# %%
hsdp = run_workers(fsdp_workers.flag_matrix_row, 4, "--hsdp 2", timeout_s=300)[0]
for key, sent in sorted(hsdp["wire_bytes_by_group"].items()):
    print(f"{key:40s} {sent:9,d} B per rank per step")
shard_bytes = hsdp["state"]["grads"]  # 本 rank 负责的梯度分片
by_axis = hsdp["wire_bytes_by_group"]
assert by_axis["dp_shard c10d._allgather_base_"] == gather["fp32 (default)"]
assert by_axis["dp_shard c10d._reduce_scatter_base_"] == base["wire_bytes"]["c10d._reduce_scatter_base_"]
assert by_axis["dp_replicate c10d.allreduce_"] == 2 * (2 - 1) / 2 * shard_bytes
assert not any(key.startswith("dp_replicate") and "gather" in key for key in by_axis)

# %% [markdown]
# 每个 rank 发送的 all-gather 和 reduce-scatter 字节数与 2 个 rank 上的普通 FSDP 相同，另外再加上它那 1/2 分片在 2 个副本之间的 all-reduce：2 (R-1)/R x 分片字节数，这里 R = 2 个副本。把复制维度放在节点之间，跨节点的就只有这一次 all-reduce。
#
# ## 从 FSDP1 到 FSDP2
#
# FSDP2 用对每个模块调用一次函数，取代了 FSDP1 的包装类。下面的 diff 移植了一个典型的 FSDP1 脚本，其后的表格把 FSDP1 的每个选项对应到 FSDP2。FSDP1 本身需要加速器，所以它那一侧只能在 GPU 上运行；下面的单元格展示它在这台 CPU 上如何拒绝运行。
#
# <details><summary>为什么这里不运行 FSDP1</summary>
#
# FSDP1 的构造函数要求有加速器。改传 `device_id=torch.device("cpu")` 的话，进程直接以 SIGSEGV 崩溃（torch 2.13）。所以表中 FSDP1 那一侧仅限 GPU，CI 中不执行。
# </details>

# %%
fsdp1 = run_workers(fsdp_workers.fsdp1_refuses_cpu, 2, timeout_s=120)[0]
print("FullyShardedDataParallel(model) on CPU:", fsdp1)
assert fsdp1 == "FSDP needs a non-CPU accelerator device, but no accelerator device is detected."

# %% [markdown]
# 迁移本身，用 diff 来看：`lessons/fsdp1_train.py` 是一个常见写法的 FSDP1 脚本（auto-wrap 策略、`ShardingStrategy.FULL_SHARD`、`MixedPrecision`、在 rank 0 上 gather 的完整 state dict），`lessons/fsdp2_train.py` 是它的 FSDP2 移植版：

# %%
import difflib  # noqa: E402

fsdp1_path, fsdp2_path = (ROOT / "lessons" / n for n in ("fsdp1_train.py", "fsdp2_train.py"))
print("\n".join(difflib.unified_diff(fsdp1_path.read_text().splitlines(),
                                     fsdp2_path.read_text().splitlines(),
                                     "fsdp1_train.py", "fsdp2_train.py", lineterm="", n=1)))

# %% [markdown]
# 移植版可以在这里运行。在 fp32 下，它训练出的结果必须与单进程（同一脚本在 1 个 rank 上运行）一致，误差在 1e-5 以内；使用默认的 bf16 策略也能运行（gloo 对 bf16 做 all-gather）：

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
# 与 FSDP1 本身的对比需要 GPU：`tests/test_fsdp_migration.py` 在 2 块 GPU 上以 fp32 运行两个脚本，逐个比较参数，误差在 1e-5 以内（仅限 GPU，在这台机器上会注明原因后跳过，所以 CI 中不执行）。两者的 state dict 键名相同（`0.norm.weight` 等）：FSDP1 的完整 state dict 会去掉包装器加的前缀，而 `get_model_state_dict` 返回的是模型自身的参数名。
#
# | FSDP1（`FullyShardedDataParallel`） | FSDP2（`fully_shard`，torch >= 2.6） |
# |---|---|
# | `FSDP(model, auto_wrap_policy=transformer_auto_wrap_policy(...))` | 对每个 block 调用 `fully_shard(block)`，再调用 `fully_shard(model)` |
# | 每个包装单元一个 `FlatParameter` | 每个参数都是放置方式为 `Shard(0)` 的 `DTensor` |
# | `ShardingStrategy.FULL_SHARD` | `reshard_after_forward=True`（默认值 `None` 等同于 `True`，但根单元除外，它保持 gather 状态） |
# | `ShardingStrategy.SHARD_GRAD_OP` | `reshard_after_forward=False` |
# | `ShardingStrategy.HYBRID_SHARD` | 一个 2D 网格 `(replicate, shard)`：`init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("dp_replicate", "dp_shard"))` |
# | `ShardingStrategy.NO_SHARD` | 分片维度大小为 1 的网格，或者直接用 DDP |
# | `MixedPrecision(param_dtype=..., reduce_dtype=..., buffer_dtype=...)` | `MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)` |
# | `CPUOffload(offload_params=True)` | `CPUOffloadPolicy()` |
# | `with model.no_sync():` | `model.set_requires_gradient_sync(False)` |
# | `FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)` | `get_state_dict` / `set_state_dict` + `torch.distributed.checkpoint` |
# | `FSDP.clip_grad_norm_(...)` | `torch.nn.utils.clip_grad_norm_`（支持 DTensor 梯度） |
#
# ## 网上流传的错误建议
#
# 下面三种说法出自广为转载的笔记，我们用已安装的 torch 逐一验证：

# %%
try:
    from torch.distributed.fsdp import HybridShard  # noqa: F401
    hybrid_shard_exists = True
except ImportError as exc:
    hybrid_shard_exists = False
    print("ImportError:", exc)
assert not hybrid_shard_exists  # 没有 HybridShard 这个类；HSDP 是一个 2D 设备网格

from torch.distributed.fsdp import ShardingStrategy  # noqa: E402

doc = " ".join(ShardingStrategy.__doc__.split())
hybrid = doc[doc.index("``HYBRID_SHARD``"):].split(". ")[0]
print(hybrid)
assert "within a node, and replicate parameters across nodes" in hybrid
assert "(Replicate(), Shard(dim=0))" in ws4[0]["hsdp"]["layout"][0]  # FSDP2 的同一思路：设备网格

from torch.distributed.fsdp import fully_shard  # noqa: E402

major, minor = (int(x) for x in torch.__version__.split(".")[:2])
print(f"torch {torch.__version__}: from torch.distributed.fsdp import fully_shard -> "
      f"{fully_shard.__module__}")
assert (major, minor) >= (2, 6)

# %% [markdown]
# - **“`HybridShard(intra_node_sharding_strategy=..., inter_node_sharding_strategy=...)`”**：根本没有这个类。FSDP1 的写法是 `sharding_strategy=ShardingStrategy.HYBRID_SHARD`；FSDP2 的写法是 2D 网格。
# - **“HYBRID_SHARD 在节点内复制、跨节点分片”**：说反了。它是在节点*内*分片（由快速链路承担 all-gather 和 reduce-scatter），在节点*之间*复制（只有梯度分片的 all-reduce 经过慢速网络）。出于同样的原因，实验脚本的 `--hsdp R` 把分片维度放在最后（内层，即相邻编号的 rank）。
# - **“PyTorch 2.0 起就有 FSDP2”**：`fully_shard` 最早在 2.4 中以原型形式出现在 `torch.distributed._composable.fsdp` 下，到 2.6 才作为 `torch.distributed.fsdp.fully_shard` 正式公开（pytorch/pytorch PR #141868）。请在 2.6 或更新的版本上使用它；上面的 import 只能证明当前安装的版本可用，不能证明更老的版本也行。
#
# ## 小结
#
# - 每个 rank 的常驻状态：DDP 在 fp32 + AdamW 下为每个参数 16 B，与 N 无关；ZeRO-3/FSDP 为 16/N。这里的实测值与估算器相差在 5% 以内，FSDP 与 DDP / N 相差也在 5% 以内。
# - FSDP = 分片 + 使用前 all-gather + 反向传播后 reduce-scatter；手动实现得到的数值与 `fully_shard` 相同。它发送的字节数约为 DDP 的 1.5 倍，换来 1/N 的内存。
# - HSDP 在组内（一个节点内）分片、在组间复制：跨越较慢链路的只有梯度分片的 all-reduce。
# - 在 meta 设备上构建，先对各个 block、再对根模块调用 `fully_shard`，然后 `to_empty`，最后填充各自的分片。
# - 峰值比表中的数字高：还要加上 gather 出来的单元、它的预取、激活值和 buffer。
#
# ## 练习
#
# - **带评分：** ZeRO-1 分片优化器。填写 `exercises/zero1.py`，然后运行 `python exercises/grade.py zero1`：评分脚本会逐项把你的代码与单进程的结果对比（[练习](../exercises/README.md)）。
# - **带评分：** 手写 FSDP（分片、all-gather、释放、reduce-scatter）。填写 `exercises/fsdp.py`，然后运行 `python exercises/grade.py fsdp`：评分脚本会逐项把你的代码与单进程的结果对比（[练习](../exercises/README.md)）。
#
# 下面每道练习都收在[入门练习](../docs/onboarding-exercises.md)里，配有一段自查代码（你的答案必须通过的一段 Python）和一份折叠起来的参考答案。
#
# 1. **70B 模型的显存表**：70B 模型在 FSDP 下每个 rank 的状态大小，以及 8B 模型在混合精度下的大小（[入门练习](../docs/onboarding-exercises.md#exercise-21-the-70b-memory-table)中的练习 2.1）。
# 2. **FSDP 持有的每一个字节**：词表无法均匀切分时，lab02 在 2 个 rank 上测得的带填充分片（[入门练习](../docs/onboarding-exercises.md#exercise-22-every-byte-fsdp-holds)中的练习 2.2）。
# 3. **不用 torchrun 读取分片检查点**：DCP 检查点里，每个张量的哪一部分由哪个 rank 写入（[入门练习](../docs/onboarding-exercises.md#exercise-23-read-a-sharded-checkpoint-without-torchrun)中的练习 2.3）。
# 4. **512 张 GPU 上的 HSDP**：`--hsdp` 下每个 rank 的状态大小和副本之间的通信量，以及能装下 70B 模型的最小分片组（[入门练习](../docs/onboarding-exercises.md#exercise-24-hsdp-on-512-gpus)中的练习 2.4）。
#
# ## 出问题时
#
# - 显存不足，或显存占用高于估算值：见 [只在多 rank 时显存不足](../runbooks/oom-distributed-causes.md)和 [显存不足的缓解手段](../runbooks/oom-mitigations.md)。
# - 某个 rank 卡在 all-gather 或 reduce-scatter 中：实验中的每一次等待都受 `--timeout-s`（默认 120 s）约束，它会传给 `init_process_group` 和每个网格轴（`init_mesh()`：否则 `init_device_mesh` 创建的子进程组在 gloo 上会等 30 分钟，在 NCCL 上等 10 分钟），所以卡住的集合通信会变成一个报错，而不是悄无声息地卡死（[集合通信超时，原因 D](../runbooks/collective-timeout.md)）。
# - 断点续训时选错了检查点：只有包含 DCP `.metadata` 的 `step_*` 目录才算数（`lab.latest_checkpoint`）；`.tmp` 目录是一次没有完成的保存。
