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
# # 04 · 流水线并行
#
# 学完本课，你将能够：
#
# - 说清流水线传输的是什么（前向传激活值，反向传梯度，只有点对点通信），以及它为什么会空闲（气泡），并给出公式；
# - 用 `dist.send` / `dist.recv` 手动跑一个两阶段流水线，并证明它算出的梯度与单进程相同；
# - 把模型切成若干个 `PipelineStage`，并用 `labs/lab04_pipeline.py` 运行 `torch.distributed.pipelining` 提供的每一种调度（GPipe、1F1B、Interleaved1F1B、LoopedBFS、InterleavedZeroBubble、ZBVZeroBubble、DualPipeV）；
# - 读懂实测的时间线（每种调度一张甘特图），把其中的气泡与理论值比较，并解释两者的差异；
# - 证明 1F1B 同时保留激活值的微批次比 GPipe 少，并把 PP 与 FSDP 组合使用（`--dp`）。
#
# 所有代码都能在笔记本电脑的 CPU 上通过 gloo 运行；换到 GPU 上，同一个实验走 NCCL。

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

import lab04_pipeline as lab  # noqa: E402  （实验可以直接导入：导入时什么都不执行）
import labkit.pipeline  # noqa: E402  （实验工具包：各调度类的规则）
import pipeline_workers  # noqa: E402  （worker 函数放在模块里：spawn 会重新导入它们）
from spawn import launch_lab, run_workers  # noqa: E402

# %% [markdown]
# ## 为什么
#
# 数据并行（第 01、02 课）让每个 rank（进程编号）承担整个模型的*计算*：即使 FSDP 把存储分片了，每个 rank 仍然要跑每一层。流水线并行（PP）则按层切分模型：rank 0 跑第 0..k-1 层，rank 1 跑接下来的 k 层，依此类推。
#
# 跨越切分点的只有两样东西：每个微批次前向时的一个激活值张量，以及反向时传回来的对应梯度。它们都在相邻 rank 之间点对点传输，完全没有集合通信。所以在各种并行方式里，PP 最经得起慢速链路（跨节点）；如果每步连一层的 FSDP 通信量都嫌多，就该用它。
#
# 代价是空闲时间。阶段 2 要等阶段 1 处理完微批次 0 才能开始处理它，而阶段 1 在最后要等梯度传回来。设有 `p` 个阶段、`m` 个开销相同的微批次，每个 rank 在 `m + p - 1` 个时间槽里只有 `m` 个在干活，所以**气泡**占一步的 `(p - 1) / (m + p - 1)`（GPipe，Huang 等人 2019，arXiv:1811.06965）：

# %%
def bubble(p, m, v=1):
    """Idle share of a step; v = stages per rank (interleaved), v = 1 otherwise."""
    return (p - 1) / (v * m + p - 1)


for p, m in [(4, 4), (8, 8), (8, 32), (8, 64)]:
    print(f"p={p} stages, m={m:>2} microbatches: bubble {bubble(p, m):.0%}")
assert round(bubble(8, 8), 2) == 0.47 and bubble(8, 32) < 0.18
# 每个 rank 4 个阶段，效果等同于把微批次数增加到 4 倍，而微批次不必变小：
assert abs(bubble(8, 8, v=4) - bubble(8, 32)) < 1e-12

# %% [markdown]
# Megatron-LM 的论文和 Ultra-Scale Playbook 把气泡写成 `(p - 1) / m`。两者并不矛盾：它把同样的 `p - 1` 个空闲时间槽除以 `m` 个有效计算的时间槽，而上面的公式除以的是整步，即 `m + p - 1`。记 `r = (p - 1) / m`，则气泡占一步的比例是 `r / (1 + r)`。`m` 远大于 `p` 时两者几乎相等；`p = m = 8` 时，一个说在计算之外多出 88%，另一个说占一步的 47%。本课程和 lab04 的指标用的都是占一步的比例。

# %%
def bubble_over_compute(p, m, v=1):
    """Idle time relative to the ideal compute time: Megatron-LM's and the Playbook's form."""
    return (p - 1) / (v * m)


for p, m in [(4, 4), (8, 8), (8, 32)]:
    r = bubble_over_compute(p, m)
    print(f"p={p}, m={m:>2}: idle / compute {r:.0%}, idle / step {bubble(p, m):.0%}")
    assert abs(r / (1 + r) - bubble(p, m)) < 1e-12  # 同一个调度，两种分母

# %% [markdown]
# 缩小气泡有两种办法：一是增加微批次数量（batch size 固定时，微批次随之变小，每个 kernel 的工作量也更少）；二是让每个 rank 承担 `v` 个更薄的阶段（*交错*）。后者的公式变为 `(p - 1) / (v m + p - 1)`，效果等同于把微批次数量增加到 `v` 倍，代价是发送次数也变为 `v` 倍。
#
# 零气泡调度更进一步，把反向拆成两部分：先算输入梯度，因为上一个阶段在等它；权重梯度留到后面算，用来填补空隙。
#
# ## 从零开始：手动实现两个阶段
#
# `pipeline_workers.gpipe_by_hand` 在两个进程上运行一个一分为二的小 MLP。rank 0 对每个微批次运行前半部分，并用 `dist.send` 把激活值发出去；rank 1 用 `dist.recv` 收下，完成前向并计算损失。然后是反向：rank 1 把对自身输入的梯度发回去，rank 0 用 `out.backward(grad)` 接着走链式法则。

# 下面就是手动实现的完整一步（`lessons/pipeline_workers.py`）。两个 rank 都在这台机器唯一的单调时钟上记录时间，以较早开始的那个 rank 为起点；每个动作的开始时间都在它所等待的接收*之后*才记录，所以等待只会表现为空隙，不会被算成工作：

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
# 损失相同，梯度也相同：把每个微批次的损失除以 `m`、再把各个梯度相加，得到的正是整个 batch 平均损失的梯度。下面把它画在共享时钟上，用的图和后面实验运行的图相同（颜色表示动作，标签表示微批次）：

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
            if end - start > 0.025 * span:  # 只在放得下的地方标注
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

# 填充与排空，用同一个时钟（本机的）衡量：rank 0 做完微批次 k，rank 1 才开始它；
# rank 1 做完 k 的反向，rank 0 才开始 k 的反向。这个顺序由接收操作保证，
# 所以不论机器多忙都成立。
forward = {(r, mb): (s, e) for r, ev in enumerate(by_hand) for k, mb, s, e in ev if k == "F"}
backward = {(r, mb): (s, e) for r, ev in enumerate(by_hand) for k, mb, s, e in ev if k == "B"}
for mb in range(MICRO):
    assert forward[1, mb][0] > forward[0, mb][1]
    assert backward[0, mb][0] > backward[1, mb][1]
assert forward[0, 0][0] < forward[0, 0][1] < forward[1, 0][0]  # rank 0 先开始；rank 1 等待

# %% [markdown]
# 这就是“填充-排空”的形状：rank 1 一直空闲，直到 rank 0 的第一个激活值到达；rank 0 从最后一次前向结束起空闲，直到第一个梯度传回来。这两端的空闲就是气泡。
#
# （rank 1 的条更长，因为它那一半包含三个线性层中的两个，外加损失计算。worker 会先跑一次不计时的前向和反向：在这台机器上，进程里的第一次反向要付出 180 ms 的一次性初始化开销，不先跑掉的话，其他一切都会被它淹没。）
#
# ## 使用 PyTorch
#
# `torch.distributed.pipelining` 替你记这些账：`PipelineStage` 包装模型的一个切片，并知道自己的邻居是谁；调度决定各个动作的顺序，包括前向（F）、反向（B），以及零气泡调度中的输入梯度（I）和权重梯度（W），并发出相应的发送和接收。
#
# 实验按层编号切分模型。各层保存在一个以编号为键的 `ModuleDict` 中，所以每个阶段都保留了整个模型的参数名：它得到的初始权重与单进程参考相同，检查点也与模型怎么切分无关：

# %%
print(inspect.getsource(lab.build_stage_module))
print(inspect.getsource(lab.cut_stage))  # 来自工具包：labs/labkit/pipeline.py
print(inspect.getsource(lab.stage_ids_for_rank))

# %% [markdown]
# 一个 rank 持有哪些阶段取决于调度：循环（looped）调度把阶段 `s` 放在 rank `s % pp` 上；V 形调度让 rank `r` 持有阶段 `r` 和 `2 pp - 1 - r`。前向先沿着 rank 往下走，再折返往上，所以 V 的拐点（从阶段 `pp - 1` 到阶段 `pp`）落在最后一个 rank 上，它同时持有这两个阶段，这一跳不需要发送。（rank 0 同时持有第一个和最后一个阶段，是 V 的另一端：输入和损失在同一个 rank 上。）
#
# 下面是每个调度类要求的约束。实验在创建任何进程组之前就会检查它们，所以错误的组合只会得到一行报错和退出状态 2，而不是卡死：

# %%
for name, spec in lab.SCHEDULES.items():
    fixed = spec["stages_per_rank"] or "V (--stages-per-rank)"
    print(f"{name:22s} placement {spec['placement']:4s} stages/rank {fixed!s:22s} "
          f"microbatches {spec['microbatches']:9s} since torch {spec['since']}")
v_cfg = argparse.Namespace(schedule="ZBVZeroBubble", stages_per_rank=2)
loop_cfg = argparse.Namespace(schedule="Interleaved1F1B", stages_per_rank=2)
assert lab.stage_ids_for_rank(0, 2, v_cfg) == [0, 3] and lab.stage_ids_for_rank(1, 2, v_cfg) == [1, 2]
for pp in (2, 4):  # 无论 pp 是多少，拐点（阶段 pp - 1 -> pp）都在最后一个 rank 上
    assert {pp - 1, pp} == set(lab.stage_ids_for_rank(pp - 1, pp, v_cfg))
assert lab.stage_ids_for_rank(0, 2, loop_cfg) == [0, 2]

# %% [markdown]
# ## 为每种调度运行实验
#
# 两个 rank，4 层，每步 4 个微批次。GPipe 和 1F1B 每个 rank 一个阶段（共 2 个阶段）；其余调度每个 rank 两个阶段（共 4 个阶段）。
#
# 每次运行都会在相同的 batch 上与单进程运行做一致性检查：每一步的损失、第一步的每个梯度、最后一步之后的每个参数，全部在 1e-5 以内。
#
# <details><summary>这几次运行是怎么启动的</summary>
#
# 第一次运行启动的是真正的 torchrun，和你自己运行时一样；其余几次的 rank 从一个已经导入过 torch 的服务进程 fork 出来（`lessons/spawn.py` 中的 `launch_lab`），在 2 核笔记本上每次约省 10 s 启动时间。
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
                         "--check-parity", torchrun=not runs)  # 第一次照你平时的方式运行
for name, m in runs.items():
    worst = max(m["parity_max_abs_diff"], m["grad_parity_max_abs_diff"],
                m["loss_parity_max_abs_diff"])
    print(f"{name:22s} params {m['parity_max_abs_diff']:.1e}  step-1 grads "
          f"{m['grad_parity_max_abs_diff']:.1e}  losses {m['loss_parity_max_abs_diff']:.1e}")
    assert worst <= 1e-5

# %% [markdown]
# ## 时间线
#
# 每次运行都记录了每个前向/反向在每个 rank 上的起止时间（实验包装了每种调度都会调用的三个 `PipelineStage` 方法，所以等待发送和接收的时间不算作工作）。下面每种调度画一步（取气泡为中位数的那一步），全部使用同一条时间轴。标签是微批次，颜色是动作。

# %%
fig, axes = plt.subplots(len(runs), 1, figsize=(8, 1.7 * len(runs) + 0.8), sharex=True)
for ax, (name, m) in zip(axes, runs.items()):
    # 实验的事件是 (kind, stage, microbatch, start, end, cpu time)：只保留要画的部分。
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
# ## 实测气泡与理论值对比
#
# 对每一步，实验逐个 rank 计算 `1 - busy / span`（span 指从任一 rank 上的第一个动作到最后一个动作的时长），再对各 rank 取平均。它报告三个数：
#
# - **measured**（实测）：实际耗时，取中位数那一步。它包含所有真实因素：send/recv 延迟、动作之间的 Python 开销，以及共享机器上其他进程抢走的 CPU 核。
# - **replayed**（回放）：按中位数那一步在每个 rank 上的动作顺序回放，每个动作的耗时取同类型、同阶段实测到的最短 CPU 时间（干扰只会增加时间），通信视为瞬时完成。它去掉了延迟和资源争用，但保留了公式忽略的因素：各阶段开销不相等（阶段 0 还要做嵌入，最后一个阶段还要做归一化并投影到词表），以及反向的开销约为前向的两倍。
# - **equal stages**（等开销阶段）：同样的回放，但采用公式的假设，即每个阶段一样快（前向 1，反向 2）。剩下的就只有调度本身的形状。

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
# 实测值与公式差多少？在等开销阶段下，回放恰好给出公式的值（上面已断言，测试套件里也有同样的断言）：公式对调度形状的描述是对的。用实测开销回放时，结果比公式高，高多少取决于这次运行各阶段不均衡的程度：在一台共享的 2 核虚拟机上把同样的运行跑几次，高出 0.00 到 0.12 不等。两者都不会低于公式：均衡的流水线就是最好的情况。
#
# 这里实测的气泡远高于公式，原因在于规模：这个小模型的每个动作只要几毫秒，而 CPU 上一次 gloo 收发加上动作之间的 Python 代码，就要占去其中相当大的比例；两个 rank 还要和机器上正在运行的其他程序共享资源，所以按实际耗时测，1F1B 的气泡甚至可能比 GPipe 还大。在 GPU 上用真实的层大小时，每个动作要几十毫秒，测量值就会向回放值靠拢。[第 06 课](06_performance.ipynb#3-the-pipeline-bubble-where-compute-dominates)把每个微批次的工作量加重约 250 倍并做了测量：此时 GPipe 和 1F1B 都落在公式的 15% 以内，交错调度则比两者都低。
#
# 零气泡调度没有简单的闭式公式；其论文（Qi 等人 2024，arXiv:2401.10241）称，当前向、输入梯度和权重梯度的开销相同时，气泡接近于零，而 4 个微批次的 CPU 运行并不满足这个条件。
#
# ## 显存：1F1B 持有的微批次比 GPipe 少
#
# 1F1B 的气泡与 GPipe 相同，只是顺序不同：先做 `pp - rank` 次预热前向，之后交替执行一次前向、一次反向，所以一个 rank 同时持有的激活值永远不超过 `pp - rank` 个微批次。GPipe 则先跑完全部 `m` 次前向。
#
# 实验用 `torch.autograd.graph.saved_tensors_hooks` 统计 autograd 为反向保存的字节数（每块存储只计一次，不含参数），并从时间线中统计同时 in flight（已发出前向、尚未完成反向）的微批次数量：

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
# 当 `m` 远大于 `p` 时（这是让气泡变小的唯一办法），这就是持有 `m` 个微批次与持有 `p` 个微批次的区别，也正是 1F1B 在实践中取代 GPipe 的原因。
#
# ## PP 与 FSDP、TP 组合
#
# `--dp N` 在一个 `("pp", "dp")` 设备网格上并排运行 N 条流水线，rank 编号为 `pp_rank * dp + dp_rank`。与 torchtitan 一样，“pp”是外层轴，所以在多节点作业中，各阶段分布在不同节点上（一个切分点每个微批次只发送一个激活值，是所有通信中最轻的）；而每个 dp 组（负责对本阶段的权重做 all-gather 和 reduce-scatter）由同一节点内相邻的 rank 组成。
#
# 每个阶段都在 `dp` 轴上用 `fully_shard` 分片；调度会把梯度的 reduce-scatter 推迟到最后一个微批次（`reshard_after_forward=False` 让阶段的参数在整步中保持未分片状态，否则每个微批次都要重新 all-gather 一次）。测试套件会运行 `torchrun --nproc-per-node 4 labs/lab04_pipeline.py --dp 2 --check-parity`，并与同一个单进程参考对照。
#
# 大型作业还会在每个阶段内部加上张量并行，构成 3-D 网格 `("pp", "dp", "tp")`：TP 在最内层，走最快的链路（节点内）；PP 在最外层，跨节点；FSDP 居中。第 05 课会在 8 个进程上用[lab05_3d](../labs/lab05_3d.md) 把它搭起来。
#
# ## 何时选择流水线并行
#
# - 模型即使分片后也放不下，或者在你的互联上 FSDP 逐层的 all-gather 无法与计算重叠：PP 每个切分点、每个微批次只发送一个激活值。
# - 你负担得起大量微批次（全局 batch 很大）：气泡要小，需要 `m >> p`。
# - 各层结构一致（Transformer block），各阶段容易均衡；首尾阶段上的嵌入层或大词表投影会打破均衡（在上面的回放中可以看到）。
# - 优先考虑 1F1B（省显存）或 Interleaved1F1B（气泡小）；只有当权重梯度的计算量大到足以填满空隙时，零气泡调度才划算。
#
# ## 小结
#
# - PP 按层切分模型；相邻 rank 之间以点对点方式交换激活值和梯度。
# - 气泡为 `(p - 1) / (m + p - 1)`，交错时约除以每个 rank 的阶段数 `v`。本课实测并做了对比：等开销阶段的回放恰好给出公式值，用实测开销的回放比公式高 0.00 到 0.12，实际耗时则比两者都高（只要每个阶段的计算量足够大，把每个阶段的实测耗时代入公式，第 06 课测得的气泡就落在公式的 15% 以内）。
# - 1F1B 最多持有 `pp - rank` 个微批次，GPipe 则持有全部 `m` 个：这一点用保存的字节数实测过。
# - 每种调度训练出的模型都与单进程相同：一致性在 1e-5 以内。
#
# ## 练习
#
# - **带评分：** 用 send 和 recv 手写 GPipe 和 1F1B。填写 `exercises/pipeline.py`，然后运行 `python exercises/grade.py pipeline`：评分脚本会逐项把你的代码与单进程的结果对比（[练习](../exercises/README.md)）。
#
# 下面每道练习都收在[入门练习](../docs/onboarding-exercises.md)里，配有一段自查代码（你的答案必须通过的一段 Python）和一份折叠起来的参考答案。
#
# 1. **气泡的预测值与实测值**：在 lab04 实测之前，先预测 1F1B 的气泡和同时持有激活值的微批次数（[入门练习](../docs/onboarding-exercises.md#exercise-41-the-bubble-predicted-and-measured)中的练习 4.1）。
# 2. **哪些阶段放在哪个 rank 上**：在 4 个 rank 上，`Interleaved1F1B` 和 `ZBVZeroBubble` 各给每个 rank 分配哪些阶段（[入门练习](../docs/onboarding-exercises.md#exercise-42-which-stages-live-on-which-rank)中的练习 4.2）。
# 3. **GPipe 和 1F1B 各持有多少激活值**：两种调度下，对任意 pp 和 m，每个 rank 同时持有多少个微批次的激活值（[入门练习](../docs/onboarding-exercises.md#exercise-43-the-activations-gpipe-and-1f1b-hold)中的练习 4.3）。
#
# ## 出问题时
#
# - 某个 rank 在发送或接收里一直等下去：各 rank 对调度或微批次数量的设置不一致；见[集合通信超时](../runbooks/collective-timeout.md)和[某个 rank 卡住或变慢](../runbooks/stuck-rank.md)。实验的 `--timeout-s` 会把这种等待变成报错。
# - 使用 GPipe 时第一个阶段显存不足：换成 1F1B，见[显存不足的缓解手段](../runbooks/oom-mitigations.md)。
# - 更多排障手册：[排障手册索引](../runbooks/index.md)。实验本身：[lab04_pipeline](../labs/lab04_pipeline.md)。
