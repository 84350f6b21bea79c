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
# # 05 · 3D 并行：流水线 x FSDP x 张量并行
#
# 学完本课，你将能够：
#
# - 说清每个并行维度发什么、多久发一次，并据此判断它在集群上该放在哪里：TP 放在节点内，PP 和 FSDP 跨节点，并拿 70B 模型的数字来佐证；
# - 用课程的估算器读出 70B 方案在 64 块和 512 块 GPU 上的单卡显存占用，并说明为什么必须打开激活检查点才放得下；
# - 用 `labs/lab05_3d.py` 按 torchtitan 的顺序（先切成阶段，再在每个 block 内做 TP，最后在 dp 上做 FSDP）搭建 `("pp", "dp", "tp")` 设备网格，并逐个维度数出一步里的集合通信次数，和公式对照；
# - 把三个维度在一步里的活动画在同一条时间线上；
# - 证明三种布局训出的模型与单进程训出的相同（一致性误差在 1e-5 以内），而且同一个检查点能在三种不同的布局上断点续训。
#
# 全部内容都能在笔记本电脑的 CPU 上跑：2 个核跑 8 个 gloo 进程。换到 GPU 上，同一个实验改用 NCCL。

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

import lab05_3d as lab  # noqa: E402  （实验可以直接导入：导入时什么都不执行）
import threed_workers  # noqa: E402  （worker 函数放在模块里：spawn 会重新导入它们）
from labkit.model import MODEL_PRESETS, flops_per_token  # noqa: E402  （实验工具包）
from spawn import launch_lab, run_workers  # noqa: E402

# %% [markdown]
# ## 三个维度，三种通信
#
# 前面的实验各自只切分一样东西：
#
# | 维度 | 所在课 | 切分什么 | 发送什么 | 多久一次 |
# |---|---|---|---|---|
# | tp | 03 | 每个权重矩阵，按列或按行切 | 对一个激活值做 all-reduce | 每个 block 每个微批次 4 次（前向 2 次，反向 2 次） |
# | dp（FSDP） | 02 | 每个权重，切成分片 | all-gather 权重，reduce-scatter 梯度 | 每个 block 每步一次：在 PP 下，实验让权重一直保持 gather 后的状态（`reshard_after_forward=False`）；lab02 的 FSDP 要 gather 两次 |
# | pp | 04 | 模型的层，分成若干阶段 | 前向传出一个激活值，反向传回它的梯度 | 每个切分点每个微批次一次 |
#
# 这些次数相差好几个数量级，所走的链路自然也得不同。下面计算 Llama-3.1-70B（80 个 block，宽度 8192）在 64 块 GPU 上按 pp 4 x dp 2 x tp 8 排布时，每块 GPU 每步发送的字节数：8 个微批次，每个微批次是一条 8192 token 的序列，激活值用 bf16。这些数字是按公式算的（环形集合通信，见第 00 课），不是实测值。

# %%
def bytes_per_step(cfg, pp, dp, tp, microbatches, act_bytes=2, param_bytes=2, grad_bytes=4):
    """Bytes one rank of the busiest stage sends per step, per axis (ring algorithms)."""
    activation = cfg["micro_batch"] * cfg["seq_len"] * cfg["dim"] * act_bytes
    blocks = cfg["num_layers"] // pp
    stage_params = cfg["num_params"] / pp
    ring = lambda n: (n - 1) / n  # noqa: E731  （每个 rank 发送的缓冲区占比）
    return {
        "tp": microbatches * blocks * 4 * 2 * ring(tp) * activation,  # all-reduce: 2 (n-1)/n
        "dp": stage_params / tp * (param_bytes + grad_bytes) * ring(dp),  # gather + scatter
        "pp": 2 * microbatches * activation,  # 中间阶段：每个微批次每个方向各 send 一次
    }


LLAMA_70B = {"num_params": 70.55e9, "num_layers": 80, "dim": 8192, "seq_len": 8192,
             "micro_batch": 1}
traffic = bytes_per_step(LLAMA_70B, pp=4, dp=2, tp=8, microbatches=8)
# 公开的链路速度（来自数据手册，不是这里实测的）：H100 SXM 的 NVLink 合计 900 GB/s，
# 每个方向 450 GB/s；每张 GPU 一块 400 Gb/s 的 InfiniBand 网卡，每个方向 50 GB/s。
NVLINK, INFINIBAND = 450e9, 50e9
for axis, sent in traffic.items():
    print(f"{axis}: {sent / 1e9:7.1f} GB per step per GPU | {sent / NVLINK * 1e3:6.0f} ms on "
          f"NVLink | {sent / INFINIBAND * 1e3:6.0f} ms on InfiniBand")
assert traffic["tp"] > 10 * traffic["dp"] and traffic["dp"] > traffic["pp"]

# %% [markdown]
# 再拿这一步的计算量来比。每个 rank 承担每个微批次 1/(pp x tp) 的 FLOPs：65,536 个 token x 每 token 481 GFLOP / 32 = 986 TFLOP。H100 的 bf16 峰值是 989 TFLOP/s（数据手册上的数字），按 40% 算约需 2.5 s（40% 是个偏乐观的整数：torchtitan 公布的 Llama 3.1 8B 在 8 块 H100 上训练，达到的是 34%，第 06 课会算出这个数）。
#
# TP 约 150 GB 的流量走 NVLink 约需 0.33 s，只占计算时间的一小部分；走 InfiniBand 却要 3 s，比计算还长：**TP 必须留在节点内**。FSDP 每步约 6.6 GB，走 InfiniBand 约需 0.13 s，而且能与计算重叠（第 02 课）；PP 的约 2 GB 是三者中最轻的：**PP 和 DP 跨节点**。设备网格的维度顺序（从最外层往里）就是这么定下来的：`("pp", "dp", "tp")`，这样每个 TP 组是 8 个连续的 rank，正好占满一个节点。

# %%
llama_70b = argparse.Namespace(**MODEL_PRESETS["70b"])  # 实验的预设：70.55B 参数
flop_per_token = flops_per_token(llama_70b, llama_70b.seq_len)  # 实验的 MFU 公式
per_rank_flop = 8 * 8192 * flop_per_token / (4 * 8)  # 8 个微批次，每个 rank 各算 1/(pp x tp)
compute_s = per_rank_flop / (0.40 * 989e12)
print(f"{flop_per_token / 1e9:.1f} GFLOP per token; per GPU per step {per_rank_flop / 1e12:.0f} "
      f"TFLOP, {compute_s:.1f} s at 40% of the H100's bf16 peak")
assert traffic["tp"] / NVLINK < 0.2 * compute_s < traffic["tp"] / INFINIBAND

# %% [markdown]
# ## 每块 GPU 的显存：70B 方案在 64 块和 512 块 GPU 上
#
# `--plan` 用课程的估算器列出最忙的那个 rank 上存着什么：AdamW 加 fp32 主权重，每个参数 16 字节，按 dp x tp 均分；FSDP 一直保持 gather 状态的那些权重；以及 in flight 的微批次（已做完前向、还没做反向）的激活值。它不创建进程组，所以在这里就能跑。
#
# 最忙的是第一个阶段的 rank：20 个 block，外加词嵌入层和输出层（估算器在每个阶段都把这两层算进去），而且在 1F1B 下，它同时 in flight 的微批次最多。其中有两项不会随 dp 增大而缩小。一是在流水线下，实验让一个阶段的所有 block 整步都保持 gather 后的状态，每个 block 还各带一份未分片的 fp32 梯度（`reshard_after_forward=False`，而且流水线阶段会把 FSDP 的重新分片和梯度同步推迟到最后一个微批次：`torch/distributed/pipelining/stage.py`）。二是没有序列并行时，norm 的激活值在每个 tp rank 上都是完整的一份，一个 block 的激活值里只有其余部分按 tp 均分（`tests/test_plan_measured.py` 拿 CPU 上实测的字节数核对这两项）。

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
# dp 并行度扩大到 8 倍，状态降为 1/8；但 gather 后的阶段权重和激活值不随 dp 缩小，
# 所以光加 GPU，这种布局永远装不下。
assert abs(small["params (fp32)"] / big["params (fp32)"] - 8) < 0.01
assert small["activations"] == big["activations"] > 0.75 * 80
assert small["gathered (FSDP)"] == big["gathered (FSDP)"]
assert big["total"] > 0.9 * 80 and recompute["total"] < 0.9 * 80

# %% [markdown]
# 在 64 块 GPU 上，这个方案需要 113 GB，而 H100 只有 80 GB；到了 512 块仍需 96 GB：dp 能均分权重、梯度和 AdamW 状态（从 19 GB 降到 2.4 GB），却分摊不了 gather 后整个阶段的 14.4 GB，也分摊不了 69 GB 的激活值（1F1B 同时 in flight 的微批次已经只有 8 个中的 `pp` 个，见第 04 课）。靠加 GPU 解决不了问题，该用的是激活检查点（实验的 `--activation-checkpointing`；runbooks/oom-mitigations.md）：每个 block 只保留它的输入，69 GB 的激活值降到 14 GB，64 块 GPU 就放得下（58 GB）。序列并行（lab05 没有实现）还能把 norm 那部分也按 tp 均分。

# %% [markdown]
# ## 代码：先切分，再 TP，最后 FSDP
#
# 实验按 torchtitan 的方式构建每个阶段：`pipeline_llm()` 把模型切成若干阶段模块，然后对每个模块调用它的 `parallelize_fn`：先加张量并行，最后加 FSDP（见 torchtitan 的 `torchtitan/distributed/pipeline_parallel.py` 和 `models/llama3/parallelize.py`，commit b5bcd76）。顺序很重要：
#
# - **先切分**：每个阶段只保留自己的层，而且都在 meta 设备上，所以其余的层自始至终既不分配内存，也不做分片。
# - **先 TP 后 FSDP**：`parallelize_module` 把每个权重变成在 "tp" 上分片的 DTensor；`fully_shard` 再在 "dp" 上把它分片一次（二维放置方式）。FSDP 在 dp 上 all-gather 还原出来的，恰好是 TP 的 hook 所期望的 tp 切片。如果顺序反过来，TP 的方案拿到的参数已经由 FSDP 转成了在 dp 上分片的 DTensor（FSDP2 把每个参数存成 `Shard(0)` 的 DTensor，没有扁平缓冲区），而不是它要按 tp 切分的普通权重。
# - **最后物化**：`to_empty` 只为本地分片分配内存，然后每个分片用同一份初始权重中属于自己的那一块填充；单进程参考用的也是这份初始权重。

# %%
print(inspect.getsource(lab.build_mesh))
print(inspect.getsource(lab.build_stage_module))

# %% [markdown]
# ## 一步中的集合通信，按维度计数
#
# 8 个进程，pp 2 x dp 2 x tp 2，用实验的调试模型（4 个 block，每个阶段 2 个），4 个微批次。每个 rank 搭好实验的流水线，记下自己在一步里发起的每一次集合通信和 send，并按所在组的网格轴归类（`threed_workers.AxisRecorder`）。按每个 rank、每一步计，公式如下，`m` 是微批次数，`L` 是本阶段的 block 数：
#
# - **tp**：all-reduce 共 `m x (4 L + 1)` 次。每个 block 4 次，另加 1 次：第一个阶段是词嵌入前向的求和，最后一个阶段是输出投影输入的梯度（这个输入在各 tp rank 上是复制的）。此外，最后一个阶段还有 `m` 次 all-gather，把按词表分片的 logits 拼成完整的，用来算 loss。
# - **dp**：每个 FSDP 单元每步一次 all-gather、一次 reduce-scatter，各 `L + 1` 次（每个 block，加上本阶段的根模块），因为在 PP 下，权重整步都保持 gather 后的状态。
# - **pp**：2 个阶段时，每个 rank 都有 `m` 次 send 和 `m` 次 receive。
# - **world**：一次 all-reduce，算出梯度裁剪要用的梯度范数。

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
# 每个 rank 发起的操作都与预测完全一致：第一个阶段的 rank 共 51 次，最后一个阶段的 rank 共 55 次，其中 TP 分别占 36 次和 40 次。TP 的次数随 `m x L` 增长，而 FSDP 的只随 `L` 增长，PP 的只随 `m` 增长。在上面的 70B 布局上（pp 4，即每个阶段 20 个 block，8 个微批次），套用同一公式，第一个或最后一个阶段的 rank 每步有 8 x (4 x 20 + 1) = 648 次 TP all-reduce（中间阶段的 rank 为 8 x 80 = 640 次），FSDP 却只有 21 次 all-gather 和 21 次 reduce-scatter。TP 每步要发起数百次集合通信，所以它需要最快的链路，序列并行和异步 TP 也正因如此才费那么大力气把这些通信藏起来。

# %% [markdown]
# ## 把一步画在一条时间线上
#
# 还是同一步，按 rank 画出来：每个微批次的前向（蓝色）和反向（橙色），另外在每次发起集合通信的时刻打一个标记，颜色表示所属维度。各 rank 在这一步开始前刚一起从同一个 barrier 返回，又在同一台机器上读同一个时钟（`time.perf_counter`，在 Linux 上即 CLOCK_MONOTONIC），所以时间可以精确比较。

# %%
t0 = min(r["start"] for r in recorded)  # 所有 rank 读的是同一个单调时钟
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

# 把图上读到的逐条验证：每个 rank 上，FSDP 在任何前向结束之前就 gather 了第一个 block；
# 最后一个阶段要等第一个阶段做完微批次 0（同一 dp、tp 位置）才开始它；
# 梯度范数的 all-reduce 在所有反向之后。
for rank, r in enumerate(recorded):
    first_gather = min(t for a, op, t, _ in r["events"] if a == "dp" and "gather" in op)
    first_forward_end = min(end for kind, _, _, _, end in r["actions"] if kind == "F")
    assert first_gather < first_forward_end, rank
    norm = max(t for a, _, t, _ in r["events"] if a == "world")
    assert norm > max(end for kind, _, _, _, end in r["actions"] if kind == "B"), rank
for rank in range(4):  # pp 0 上的 rank；rank + 4 持有同一 (dp, tp) 位置的下一个阶段
    f0 = [(s, e) for kind, _, mb, s, e in recorded[rank]["actions"] if kind == "F" and mb == 0]
    f1 = [(s, e) for kind, _, mb, s, e in recorded[rank + 4]["actions"]
          if kind == "F" and mb == 0]
    assert f1[0][0] > f0[0][1], rank

# %% [markdown]
# ## 三种布局上的一致性，以及用同一个检查点在三种布局上断点续训
#
# 实验的 `--check-parity` 会在单进程里用相同的全局 batch 重训一遍，再比较最后一步后的全部参数、第一步的梯度和每一步的 loss。计划如下，共 12 步：
#
# 1. 在 pp 2 x dp 2 x tp 2 上一口气跑完，得到作为参考的 loss 曲线；
# 2. 同一布局，跑到第 4 步停下，存一个 DCP 检查点；
# 3. 在 pp 1 x dp 2 x tp 4 上断点续训（没有流水线，TP 跨 4 个 rank），在第 8 步停下；
# 4. 在单进程（pp 1 x dp 1 x tp 1）中断点续训，跑到第 12 步。
#
# 每段续训也各自做一致性检查（其参考从第 0 步训起），所以每种布局都和单进程对照过；串起来的 loss 还必须和一口气跑完那次的 loss 接得上。检查点按张量在整个模型中的名字（`layers.3.attention.wq.weight`）保存每个张量，并记下每个分片的偏移量，所以任何布局都能读出自己要的切片。
#
# <details><summary>这几次运行是怎么启动的</summary>
#
# 这些运行的 rank 都从一个已经导入过 torch 的服务进程 fork 出来（`lessons/spawn.py` 中的 `launch_lab`），每个 rank 拿到的环境变量和 torchrun 给的一样：效果与 `run_lab` 文档字符串里那条 `torchrun` 命令相同，而在 2 核笔记本上，8 个 rank 每次能省约 20 s 启动时间。
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
# ## 如何选择布局
#
# 从硬件和模型出发，按以下顺序决定：
#
# 1. **tp**：取能让一个 block 的权重和激活值放得下的最小并行度，且绝不超过一个节点内的 GPU 数（大多数服务器是 8）。并行度每翻一倍，矩阵乘法减半，也不增加新的集合通信；但每个 rank 的矩阵乘法变小了，要分担的 all-reduce 却更大了。
# 2. **pp**：只在用剩下的 GPU 做 FSDP 仍放不下模型，或者 FSDP 每步的通信在你的节点间链路上无法与计算重叠时才用。要用，就取 `m >= 4 pp` 个微批次，让气泡 `(pp - 1) / (m + pp - 1)` 足够小（第 04 课）。
# 3. **dp**：剩下的全部给它。它扩大 batch，配合 FSDP 还能均分优化器状态（即上文从 64 块扩到 512 块 GPU 的方案），但分不了激活值：那要靠激活检查点或序列并行。
#
# 有了 `--plan`，向集群申请 GPU 之前就能算清任意布局的显存够不够。
#
# ## 小结
#
# - TP 每步要发数百次激活值大小的 all-reduce（70B 布局中第一个阶段的 rank 为 648 次），FSDP 每个 block 一次 gather 和一次 reduce-scatter，PP 每个切分点每个微批次一个激活值：TP 放在节点内，PP 和 DP 跨节点。
# - 实验从外到内搭建 3D 设备网格 `("pp", "dp", "tp")`，并按 torchtitan 的顺序搭建每个阶段：切分、TP、FSDP、物化。
# - 在 8 个 rank 上实测计数，一步发起的集合通信与公式的预测完全一致。
# - 三种布局与单进程训练出同一个模型（一致性误差在 1e-5 以内），同一个 DCP 检查点可以在它们之间迁移。
#
# ## 练习
#
# 下面每道练习都带检验：[入门练习](../docs/onboarding-exercises.md)里为它配了一段自查代码（你的答案必须通过的一段 Python）和一份折叠起来的参考答案。
#
# 1. **数清每个阶段一步里的集合通信**：在 4 个阶段的一步中，数出每个 rank 发起的每一次集合通信，再与录下的一步对照（[入门练习](../docs/onboarding-exercises.md#exercise-51-count-a-steps-collectives-on-every-stage)中的练习 5.1）。
# 2. **70B 训练所需的最小集群**：找出 lab05 的 `--plan` 判定 70B 能在 H100 上放下的最小 `--nproc`，以及不开重算时的判定结果（[入门练习](../docs/onboarding-exercises.md#exercise-52-the-smallest-cluster-for-a-70b-run)中的练习 5.2）。
#
# ## 出问题时
#
# - 布局各维相乘不等于 world size，或者 `--tp` 不能整除注意力头数：实验用一行信息说明原因，在启动任何进程之前以退出码 2 退出。
# - 某个 rank 一直在等：每个维度的进程组都设了 `--timeout-s`（`init_mesh()`）；见[集合通信超时](../runbooks/collective-timeout.md)和[某个 rank 卡住或变慢](../runbooks/stuck-rank.md)。
# - 第一个阶段显存不足：见 [显存不足的缓解手段](../runbooks/oom-mitigations.md)。
# - 实验本身：[lab05_3d](../labs/lab05_3d.md)。
