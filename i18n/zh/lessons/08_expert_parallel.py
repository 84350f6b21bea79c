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
# # 08 · 专家并行：把混合专家分布到多个 rank 上
#
# 学完本课，你将能够：
#
# - 构建一个 top-k 混合专家（MoE）层：路由器、门控权重、容量因子、token 丢弃，以及负载均衡辅助损失；
# - 把它的专家分布到多个 rank 上，用两次切分大小不均的 `all_to_all_single` 调用搬运 token，并在此之前先交换计数；
# - 证明专家并行层的计算结果与单进程相同：输出、梯度以及训练后的参数，无论有没有 token 被丢弃；
# - 测量有无均衡损失时每个专家的负载、被丢弃的 token 随容量因子的变化，以及 all-to-all 的实际字节数与公式的对比。
#
# 全部内容都在笔记本电脑的 CPU 上通过 gloo 运行。已在 torch 2.13 上测试。

# %%
import inspect
import os
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import torch

ROOT = Path(os.environ.get("COURSE_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "labs" / "lab01_ddp.py").exists()))
sys.path.insert(0, str(ROOT / "lessons"))

import moe_workers as mw  # noqa: E402  （worker 函数放在模块里：spawn 会重新导入它们）
from spawn import run_workers  # noqa: E402

torch.set_num_threads(1)

# %% [markdown]
# ## 为什么
#
# 混合专家层把一个 MLP 换成 E 个 MLP，即*专家*，再加上一个很小的*路由器*，把每个 token 送往其中 k 个专家（这里 E = 8，k = 2）。模型的 MLP 参数变成原来的 E 倍，但每个 token 只需付出 k 个专家的 FLOPs。DeepSeek-V3 有 671B 参数，每个 token 激活 37B；Mixtral 8x7B 有 47B 参数，激活 13B。
#
# 模型之所以大，是因为专家多，所以要分布出去的也正是专家：专家并行（EP）的并行度为 p 时，每个 rank 持有 E/p 个专家。这样一来，token 要被送到它所选专家所在的 rank，算完再送回来。这就是 all-to-all：每个 rank 发给其他每个 rank 的数据量各不相同，由路由器在运行时决定。

# %% [markdown]
# ## 单进程中的 MoE 层
#
# 路由器为每个 token 给每个专家打分，保留得分最高的 k 个，并把它们的概率重新归一化为*门控权重*（gate）。每个专家有固定数量的槽位，即它的*容量*：容量因子 x (tokens x k / E)，也就是一个完全均衡的路由器会分给它的份额。专家会把超出容量的 token *丢弃*：这些 token 的贡献为零（在 Transformer 中，残差连接仍会把它们传到下一层）。下面是整个层：

# %%
print(inspect.getsource(mw.route))
print(inspect.getsource(mw.moe_reference))

# %% [markdown]
# 路由器只能通过门控权重获得学习信号，而偏爱少数专家的路由器会从这些专家那里得到更多梯度，于是更加偏爱它们。Switch Transformer 的辅助损失就是用来抵消这种倾向的：E · Σ_e f_e · P_e，其中 f_e 是所有路由选择中落到专家 e 的比例，P_e 是专家 e 的平均路由概率。路由器完全均匀时，它等于 1.0；每个 token 都去同样 k 个专家时，它等于 E/k。

# %%
print(inspect.getsource(mw.balancing_loss))

# %% [markdown]
# ## 手写专家并行
#
# rank r 持有 batch 中第 r 块 token，以及编号从 r·E/p 到 (r+1)·E/p - 1 的专家；路由器很小，在各 rank 上复制。一次前向传播：
#
# 1. 在本地做**路由**，并把本 rank 的 (token, 选择) 对按专家排序：这样它们也就按目标 rank 分好了组；
# 2. **交换计数**（对一张 p x E/p 的表做 `all_to_all_single`）：每个 rank 由此得知自己将从哪个 rank 收到多少 token，分别交给哪个专家；
# 3. **分发**（dispatch）：对 token 的激活值做 `all_to_all_single`，切分大小各不相同；
# 4. 每个专家按全局顺序（先按源 rank，再按 token）取出自己的 token，保留前 `capacity` 个，然后计算：留下的 token 与单进程层留下的完全相同；
# 5. **合并**（combine）：做反方向的 all-to-all，再乘以门控权重，并对每个 token 求和。
#
# 分发和合并必须可微：反向传播会把它们反过来再执行一遍。torch 2.13 中可微的 all-to-all 是 `torch.distributed._functional_collectives.all_to_all_single`（旧的 `torch.distributed.nn.functional` 版本已弃用，并提示改用前者）。

# %%
print(inspect.getsource(mw.moe_expert_parallel))
print(inspect.getsource(mw.expert_outputs))

# %% [markdown]
# 均衡损失需要*全局* batch 上的 f_e 和 P_e。f_e（计数）没有梯度，所以对计数做一次 all-reduce 就够了：之后每个 rank 加上 Σ_e f_e · P_e 中属于自己 token 的那一项；路由器的梯度和其他复制参数的梯度一样在各 rank 间求和，结果正是全局损失的梯度。

# %%
print(inspect.getsource(mw.global_statistics))

# %% [markdown]
# ## 与单进程的一致性
#
# 64 个 token，分别在 2 个和 4 个 rank 上，使用两种容量因子：1.0（这里的路由器不均衡，所以有些专家会丢弃 token）和 4.0（不丢弃任何 token）。每次运行先做一次前向和反向（检查输出和梯度），再带着均衡损失做 3 步 SGD（检查参数）。

# %%
NUM_TOKENS, CAPACITY_FACTORS, STEPS, LR = 64, (1.0, 4.0), 3, 0.5
ep_runs = {p: run_workers(mw.ep_parity, p, NUM_TOKENS, CAPACITY_FACTORS, STEPS, LR,
                          timeout_s=120)
           for p in (2, 4)}

# %%
def reference_results(capacity_factor):
    x, target = mw.make_tokens(NUM_TOKENS)
    x = x.clone().requires_grad_()
    params = {name: t.clone().requires_grad_() for name, t in mw.make_params().items()}
    out, stats = mw.moe_reference(x, params, capacity_factor)
    out.backward(target)
    trained, history = mw.train_reference(x.detach(), target, STEPS, LR, mw.AUX_WEIGHT,
                                          capacity_factor)
    return {"out": out.detach(), "x_grad": x.grad, "dropped": stats["dropped"],
            "grads": {n: t.grad for n, t in params.items()}, "params": trained,
            "history": history}


def gathered(ranks, capacity_factor, key, name=None):
    """Rank pieces put back together: tokens and experts are split in rank order; the
    router is replicated (rank 0's copy)."""
    parts = [r[capacity_factor][key] if name is None else r[capacity_factor][key][name]
             for r in ranks]
    return parts[0] if name == "router" else torch.cat(parts)


worst = {"out": 0.0, "grads": 0.0, "params": 0.0}
for capacity_factor in CAPACITY_FACTORS:
    expected = reference_results(capacity_factor)
    for p, ranks in ep_runs.items():
        diffs = {"out": (gathered(ranks, capacity_factor, "out") - expected["out"]).abs().max(),
                 "x_grad": (gathered(ranks, capacity_factor, "x_grad")
                            - expected["x_grad"]).abs().max()}
        for group in ("grads", "params"):
            for name in ("router", "w_in", "w_out"):
                diffs[f"{group}.{name}"] = (gathered(ranks, capacity_factor, group, name)
                                            - expected[group][name]).abs().max()
        assert ranks[0][capacity_factor]["dropped"] == expected["dropped"]
        assert ranks[0][capacity_factor]["history"][-1]["counts"] == \
            expected["history"][-1]["counts"]
        print(f"p={p} capacity {capacity_factor}: {expected['dropped']:2d} dropped | " +
              "  ".join(f"{n} {float(d):.1e}" for n, d in diffs.items()))
        worst["out"] = max(worst["out"], float(diffs["out"]))
        worst["grads"] = max(worst["grads"], *(float(d) for n, d in diffs.items()
                                                if n.startswith("grads") or n == "x_grad"))
        worst["params"] = max(worst["params"], *(float(d) for n, d in diffs.items()
                                                  if n.startswith("params")))
print("largest differences:", {n: f"{d:.1e}" for n, d in worst.items()})
assert worst["out"] == 0.0, "each token's output is the same sum of the same products"
assert worst["grads"] < 1e-5 and worst["params"] < 1e-5

# %% [markdown]
# 输出逐位相同：每个 token 的输出都是同样的乘积、按同样的顺序求和，与单进程中完全一样。专家的梯度也逐位相同，但路由器的梯度相差约 1e-6：它的梯度由 all-reduce 在各 rank 间求和，求和顺序与单进程不同。训练之后，参数的差异在 1e-7 左右，每个专家丢弃的 token 也完全相同。

# %% [markdown]
# ## 每个专家的负载：有无均衡损失的对比
#
# 从一个本来就不均衡的路由器出发（所有 token 都朝同一个方向偏，所以大多数 token 会选中相同的专家），在容量因子 1.25 下训练 60 步 SGD，均衡损失的权重分别取 0、1 和 4。单进程中的路由与 p 个 rank 上的路由完全相同（上面已逐步断言），所以这里只用单进程测量。

# %%
x, target = mw.make_tokens(1024, skew=1.0)
balance = {}
for weight in (0.0, 1.0, 4.0):
    _, history = mw.train_reference(x, target, 60, 0.03, weight, 1.25)
    balance[weight] = history


def imbalance(counts):
    counts = torch.tensor(counts, dtype=torch.float)
    return float(counts.max() / counts.mean())


for weight, history in balance.items():
    first, last = history[0], history[-1]
    print(f"aux weight {weight}: busiest/mean {imbalance(first['counts']):.2f} -> "
          f"{imbalance(last['counts']):.2f}, dropped {first['dropped']} -> {last['dropped']} "
          f"of {1024 * mw.TOP_K}, aux loss {first['aux']:.2f} -> {last['aux']:.2f}")
    print(f"   final tokens per expert: {last['counts']}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
for weight, history in balance.items():
    axes[0].plot([imbalance(h["counts"]) for h in history], label=f"aux weight {weight:g}")
    axes[1].plot([h["dropped"] / (1024 * mw.TOP_K) for h in history],
                 label=f"aux weight {weight:g}")
axes[0].set_ylabel("busiest expert / mean", fontsize=11)
axes[1].set_ylabel("share of choices dropped", fontsize=11)
for ax in axes:
    ax.set_xlabel("step", fontsize=11)
    ax.legend(fontsize=10)
fig.suptitle("Routing collapses without the balancing loss (capacity factor 1.25)",
             fontsize=13)
fig.tight_layout()
plt.show()

# %%
assert imbalance(balance[0.0][-1]["counts"]) > imbalance(balance[0.0][0]["counts"]), \
    "without the loss the router should concentrate"
assert imbalance(balance[4.0][-1]["counts"]) < 1.5
assert balance[4.0][-1]["dropped"] < balance[0.0][-1]["dropped"] / 10

# %% [markdown]
# 没有这项损失时，强者愈强：最忙专家的负载不断增长，超过一半的选择被丢弃。权重为 4 时，负载趋于均衡，几乎没有 token 被丢弃。Switch Transformer 用的权重是 0.01；而这里的主损失是一个小层的平方误差，它在路由器上产生的梯度远大于语言模型的，所以能与之抗衡的权重也更大。这个权重本质上是两个梯度之间的比例，而不是一个可以照抄的常数。
#
# 在 GPU 集群上，不均衡要付出双重代价：被丢弃的 token 会损害模型质量；持有最忙专家的 rank 计算时间最长，其他 rank 都要在下一次 all-to-all 处等它。

# %% [markdown]
# ## 丢弃的 token 与容量因子
#
# 一个完全均衡的路由器会丢弃 max(0, 1 - 容量因子) 比例的选择。真实的路由器丢得更多：每个超出容量的专家都会丢掉超出的部分，而其他专家空出来的槽位却无法利用。下面分别在倾斜的路由器（未训练）和经均衡损失训练后的路由器上测量：

# %%
FACTORS = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
trained_router, _ = mw.train_reference(x, target, 60, 0.03, 4.0, 1.25)
routers = {"untrained (skewed)": mw.make_params(), "trained with the balancing loss": trained_router}
dropped_share = {}
with torch.no_grad():
    for label, params in routers.items():
        dropped_share[label] = []
        for factor in FACTORS:
            _, stats = mw.moe_reference(x, params, factor)
            excess = sum(max(0, int(c) - stats["capacity"]) for c in stats["counts"])
            assert stats["dropped"] == excess  # 每个专家丢弃的恰好是超出容量的部分
            dropped_share[label].append(stats["dropped"] / (1024 * mw.TOP_K))
for label, shares in dropped_share.items():
    print(f"{label:>32}: " + "  ".join(f"{f:g}:{s:.2f}" for f, s in zip(FACTORS, shares)))

# %%
fig, ax = plt.subplots(figsize=(7, 3.6))
for label, shares in dropped_share.items():
    ax.plot(FACTORS, shares, marker="o", label=label)
ax.plot(FACTORS, [max(0.0, 1 - f) for f in FACTORS], color="gray", linestyle="--",
        label="perfectly balanced: max(0, 1 - factor)")
ax.set_xlabel("capacity factor", fontsize=11)
ax.set_ylabel("share of choices dropped", fontsize=11)
ax.set_title("Dropped tokens against capacity", fontsize=12)
ax.legend(fontsize=10)
fig.tight_layout()
plt.show()

# %%
balanced = dropped_share["trained with the balancing loss"]
skewed = dropped_share["untrained (skewed)"]
assert all(b <= s for b, s in zip(balanced, skewed))
assert all(s >= max(0.0, 1 - f) - 1e-9 for s, f in zip(balanced, FACTORS))

# %% [markdown]
# 每条实测曲线都位于均衡线之上或与之重合，经过均衡训练的路由器的曲线紧贴着均衡线。容量是为每个专家预留的内存和计算，不管用不用得上：1.25 到 2 的容量因子是常见的折中，而好的路由器能让较小的因子也够用。（一些较新的 MoE 模型，例如 DeepSeek-V3，完全不丢弃 token，它们不用辅助损失，而是在路由分数上加一个偏置来均衡负载。）

# %% [markdown]
# ## 每步的 all-to-all 字节数
#
# 对于均匀路由器，一个选择以 (p-1)/p 的概率发往另一个 rank。于是持有 T 个 token 的 rank 在分发时发送 T·k·(p-1)/p 个激活向量，每个向量有 `dim` 个浮点数，并在合并时收回同样多的数据；反向传播把这两步反过来再做一遍。每个 rank 每步的通信量：
#
# $$4 \cdot T k \frac{p-1}{p} \cdot \text{dim} \cdot 4\ \text{bytes}$$
#
# 下面用上面一致性测试中实际的切分大小来测量（64 个 token，dim 32，fp32）：

# %%
for p, ranks in ep_runs.items():
    tokens_per_rank = NUM_TOKENS // p
    uniform = tokens_per_rank * mw.TOP_K * (p - 1) / p * mw.DIM * 4
    sent = [r[CAPACITY_FACTORS[0]]["bytes_sent"] for r in ranks]
    off = (sum(sent) / p - uniform) / uniform
    print(f"p={p}: dispatch bytes per rank {sent}, uniform router predicts {uniform:.0f}; "
          f"per step (x4) {4 * sum(sent) / p:.0f} mean vs {4 * uniform:.0f} ({off:+.0%})")
    assert abs(off) < 0.25

# %% [markdown]
# 各 rank 的平均值与均匀路由器的公式相差不到 25%（这是上面单元格断言的界限；每行最后一个数字是本次运行的实际偏差）：只有 64 个 token 时，有多少选择恰好落在本 rank 自己的专家上、从而留在本地，每个 rank 都不一样。这个公式是均匀路由器下的期望值；不均匀的路由器也会让平均值偏移，偏高还是偏低，取决于它偏爱的专家放在哪些 rank 上。规模上去之后，这些数字会非常大：按 DeepSeek-V3 的形状（dim 7168，k = 8），一个 token 在每个 MoE 层、每个方向上的分发最多有 8 x 7168 = 57,344 个值，所以在 GPU 集群上，all-to-all 有专门的 kernel（例如 DeepSeek 的 DeepEP）。

# %% [markdown]
# ## 哪些能对应到 torchtitan，哪些不能
#
# torchtitan 的 MoE（`torchtitan/models/moe/moe.py` 和 `torchtitan/distributed/expert_parallel.py`，阅读的版本为 commit 003edbe）遵循同样的步骤：token-choice 的 top-k 路由（`TokenChoiceTopKRouter`）、按专家对选择做稳定的 argsort（`TokenReorderer`，与这里第 1 步的排序相同）、交换计数、用同一个 functional collectives 模块做切分大小不均的 all-to-all、专家计算，以及反方向的 all-to-all。不同之处在于：
#
# - 它的专家用一次分组矩阵乘（`torch._grouped_mm`）算完，而不是用 Python 循环；
# - 它没有容量，因此不会丢弃任何 token；它也不用辅助损失，而是在路由分数上加一个只用于 top-k 选择的偏置来均衡负载（`load_balance_coeff`，即无辅助损失的负载均衡，arXiv:2408.15664，与 DeepSeek-V3 相同）；
# - 它的专家是 `ep` 网格轴上的 DTensor，并与 FSDP 和 TP 组合，而本课传递的是普通张量和一个进程组（接下来的 lab08 会完成 DTensor 和 FSDP 的部分）。
#
# **仅限 GPU，CI 中不执行**：在 NCCL 上运行 torchtitan 的 MoE；本课程没有运行过。

# %% [markdown]
# ## 放进完整模型：lab08
#
# 本实验训练课程中的模型，把每个 block 的 MLP 换成一个 MoE 层（8 个专家，top-2），专家分布在 ("dp", "ep") 网格的 "ep" 轴上，并与 FSDP2 组合。专家是 DTensor，在 "ep" 上是 `Shard(0)`（每个 rank 持有若干个完整的专家），因此检查点按它们在整个模型中的名字存储，换任何布局都能断点续训；`fully_shard` 把它们的行在 "dp" 上切分，并把稠密层在所有 rank 上分片。还有两个细节，本课用不到：
#
# - **专家梯度的除数因子。** 在一个 ep rank 上，专家的梯度已经是其 ep 组内每个 rank 的损失之和：反向的 all-to-all 把这些梯度送回了专家所在的 rank。FSDP 随后只在 "dp" 上做归约，所以实验要除以 dp x ep，即 world size（`set_gradient_divide_factor`），而不是 dp。即使使用默认因子，参数也仍会落在单进程结果附近，因为 AdamW 会用每个梯度自己的滑动尺度去除它；正因为如此，实验还会把每一步的梯度范数与单进程做比较。
# - **全局均衡损失。** 计数在所有 rank 上做 all-reduce，所以损失值与 batch 的切分方式无关，换一个 world size 断点续训后，结果也仍然与单进程一致。
#
# 实验的 `--check-parity` 会把每个参数、每一步的梯度范数和每个专家的负载，与单进程用同样的 batch 训练的结果做比较：
#
# ```bash
# torchrun --standalone --nproc-per-node 4 labs/lab08_expert_parallel.py --ep 2 --check-parity
# ```

# %% [markdown]
# ## 小结
#
# - MoE 层把每个 token 路由到 E 个专家中的 k 个；容量限制了每个专家接收的 token 数，超出的部分被丢弃。
# - 专家并行把专家分布到各个 rank；两次切分大小不均的 all-to-all（在交换计数之后）把 token 送过去，再送回来。
# - 在 2 个和 4 个 rank 上手写实现，结果与单进程一致：输出完全相同（断言差异为 0），梯度和训练后的参数误差在断言的上界 1e-5 以内（实测差异由该单元打印出来），丢弃的 token 也相同。
# - 没有均衡损失时，路由器会坍缩到少数几个专家上，丢弃大部分 token；加上它，负载就趋于均衡（见上面的测量）。
# - all-to-all 每个 rank 每步大约搬运 4·T·k·(p-1)/p·dim 个值。
#
# ## 练习
#
# - **带评分：** 用 all_to_all_single 实现 MoE 的分发与合并。填写 `exercises/moe.py`，然后运行 `python exercises/grade.py moe`：评分脚本会逐项把你的代码与单进程的结果对比（[练习](../exercises/README.md)）。
#
# 下面每道练习都收在[入门练习](../docs/onboarding-exercises.md)里，配有一段自查代码（你的答案必须通过的一段 Python）和一份折叠起来的参考答案。
#
# 1. **dispatch 的字节数**：均匀路由时，一个 MoE 层的分发每个 rank 发送多少字节，也包括 DeepSeek 的规模（[入门练习](../docs/onboarding-exercises.md#exercise-81-the-dispatchs-bytes)中的练习 8.1）。
# 2. **不丢 token 的容量**：让 MoE 层不丢任何 token 的最小容量因子（[入门练习](../docs/onboarding-exercises.md#exercise-82-the-capacity-that-drops-nothing)中的练习 8.2）。
# 3. **只有计数才能给出的切分大小**：分发那次 all-to-all 的切分大小，以及其中哪一个离不开计数交换（[入门练习](../docs/onboarding-exercises.md#exercise-83-the-splits-only-the-counts-can-give)中的练习 8.3）。
#
# ## 出问题时
#
# - 在分发阶段卡死：各 rank 的切分大小对不上（某个 rank 跳过了计数交换，或者用了过期的计数）。每个 rank 都必须按计数交换得到的切分大小调用每一次 all-to-all（见[集合通信超时](../runbooks/collective-timeout.md)）。
# - 只有路由器梯度的一致性有偏差，而且恰好差 p 倍：每个 rank 都对整个均衡损失做了反向传播，而不是只对自己那一份。
