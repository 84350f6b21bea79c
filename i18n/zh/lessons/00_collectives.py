# ---
# jupyter:
#   jupytext:
#     formats: py:percent
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
# # 00 · 进程、rank 与集合通信
#
# 后面各课（DDP、FSDP、张量并行和流水线并行）讲的，说到底都是怎样编排少数几种通信调用。本课趁这些调用还没被任何封装藏起来，先亲手把它们调一遍。
#
# 学完本课，你将能够：
# - 说清 `torchrun` 启动了什么：进程，`RANK` / `LOCAL_RANK` / `WORLD_SIZE` / `MASTER_ADDR` / `MASTER_PORT` 这几个变量，rendezvous store（各 rank 会合用的键值存储），以及后端；
# - 预测调用 `broadcast`、`all_reduce`（SUM 和 AVG）、`reduce`、`all_gather`、`reduce_scatter`、`all_to_all`、`send` / `recv` 和 `barrier` 之后，每个 rank 持有什么；
# - 用 `send` / `recv` 手写环形 all-reduce，并解释为什么每个 rank 只需传输消息的 2(n-1)/n；
# - 测量 `all_reduce` 的延迟和带宽，并像 nccl-tests 那样解读算法带宽与总线带宽；
# - 说出 DDP、FSDP、TP 和 PP 分别会发出哪些集合通信。

# %%
import os, sys, json, subprocess
from pathlib import Path
ROOT = Path(os.environ.get("COURSE_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "labs" / "lab01_ddp.py").exists()))
sys.path.insert(0, str(ROOT / "lessons"))

import inspect
import tempfile

import matplotlib.pyplot as plt
import numpy as np
import torch

import collective_workers as cw
from spawn import run_workers

print("torch", torch.__version__, "| CUDA GPUs:", torch.cuda.device_count())

# %% [markdown]
# ## 为什么
#
# 数据并行训练在每个进程里各保留一份模型副本，每次反向传播之后，每份副本都需要所有进程梯度的总和。以一个 10 亿参数、fp32 梯度的模型跑在 8 个进程上为例：每个进程有 4 GB 梯度。最直观的做法是“所有进程都发给 rank 0，rank 0 求和后再发回去”，这样 rank 0 要接收 7 份、发送 7 份，其他 rank 则在空等。换成环形 all-reduce（下文会手写一个），每个 rank 发送的数据一样多，而且少得多，几乎不随 rank 数变化。下面的代码单元把两种方式都算了一遍。

# %%
num_params, bytes_per_grad, n = 1_000_000_000, 4, 8
grad_bytes = num_params * bytes_per_grad
naive_rank0 = (n - 1) * grad_bytes              # rank 0 先收这么多，再发同样多
ring_per_rank = 2 * (n - 1) / n * grad_bytes    # 每个 rank 发这么多，也收同样多
print(f"gradients: {grad_bytes / 1e9:.0f} GB | through rank 0: rank 0 receives "
      f"{naive_rank0 / 1e9:.0f} GB and sends {naive_rank0 / 1e9:.0f} GB | "
      f"ring: every rank sends {ring_per_rank / 1e9:.0f} GB and receives as much")
assert grad_bytes == 4e9 and naive_rank0 == 28e9 and ring_per_rank == 7e9
# 用环时，最忙的 rank 的传输量降为 2/n，n 越大差距越大。
assert naive_rank0 / ring_per_rank == n / 2

# %% [markdown]
# ## 从零开始
#
# ### 进程与 rank
#
# 分布式 PyTorch 就是若干个普通的 Python 进程，通常每块 GPU 一个。进程之间什么都不共享（各有各的内存、模型和 Python 对象），唯一的协作方式，就是按相同的顺序调用相同的通信函数。
#
# `torchrun --nproc-per-node N script.py` 在本节点上启动 N 份 `script.py`，并在每个进程中设置以下环境变量：
#
# | 变量 | 含义 |
# |---|---|
# | `RANK` | 本进程在整个作业中的编号，`0 .. WORLD_SIZE-1` |
# | `LOCAL_RANK` | 本进程在本节点上的编号：决定它该用哪块 GPU |
# | `WORLD_SIZE` | 所有节点上的进程总数 |
# | `LOCAL_WORLD_SIZE` | 本节点上的进程数 |
# | `MASTER_ADDR`、`MASTER_PORT` | rendezvous store 监听的地址 |
#
# `dist.init_process_group()`（默认的 `env://` 方式）读取的就是这些变量。`MASTER_ADDR:MASTER_PORT` 上监听着一个小型键值服务器 `TCPStore`（由 rank 0 托管；在 torchrun 下则由第一个节点上的 torchrun 进程托管）；每个 rank 都连上它，借它互相交换网络地址。之后后端（gloo 或 NCCL）才在 rank 之间建立直连。所以只要一个地址就能在多台机器上启动作业；也正因如此，`MASTER_ADDR` 一旦写错，每个 rank 都会在启动阶段一直等下去。
#
# notebook 里的单元没法用 `torchrun` 来跑，所以由 `lessons/spawn.py` 代劳：它启动 N 个进程，设置这些变量，调用 `init_process_group("gloo")`，再把各 rank 上函数的返回值收回来。下面每个 rank 报告自己看到的内容，还会自己连上 rendezvous store，把自己的进程 ID 写到一个 key 下，再等其他所有进程的 key 出现。

# %%
views = run_workers(cw.describe_process, 4, timeout_s=60)
for v in views:
    print(f"rank {v['rank']} of {v['world_size']} | pid {v['pid']} | backend {v['backend']} | "
          f"env {v['env']} | pids read from the store {v['pids_seen']}")
pids = [v["pid"] for v in views]
assert len(set(pids)) == 4                                   # 四个独立的进程
assert [int(v["env"]["RANK"]) for v in views] == [v["rank"] for v in views] == [0, 1, 2, 3]
assert all(v["world_size"] == 4 and v["env"]["WORLD_SIZE"] == "4" for v in views)
assert all(v["pids_seen"] == pids for v in views)            # 所有 rank 都在 store 里会合过
assert len({v["env"]["MASTER_PORT"] for v in views}) == 1    # 所有 rank 用同一个地址

# %% [markdown]
# ### 后端：CUDA 张量用 NCCL，CPU 张量用 gloo
#
# 真正执行通信的是后端。NCCL 用 GPU kernel 在 CUDA 张量上执行集合通信，走 NVLink、PCIe 或 InfiniBand；gloo 则在 CPU 张量上执行，走 TCP。两者的 API 相同，所以本课程的每个实验都只有一份文件，两种后端通用。各实验选后端只看一条规则：每个 local rank 都有自己的 GPU 时用 CUDA + NCCL，否则用 CPU + gloo。下面就是实现这条规则的代码：实验工具包（`labs/labkit/runtime.py`）中的 `pick_device_type`，以及 `labs/lab01_ddp.py` 中的 `init_distributed`（直接从文件里打印出来，所以就是实际运行的那份代码）：

# %%
sys.path.insert(0, str(ROOT / "labs"))
import lab01_ddp as lab01  # noqa: E402  只定义函数：导入时什么都不执行
print(inspect.getsource(lab01.pick_device_type))  # 来自它的工具包：labs/labkit/runtime.py
print(inspect.getsource(lab01.init_distributed))
assert '"nccl"' in inspect.getsource(lab01.init_distributed)
assert '"gloo"' in inspect.getsource(lab01.init_distributed)

# %% [markdown]
# 其中有两个细节在 GPU 上很关键。`torch.cuda.set_device(local_rank)` 要放在 `init_process_group` 之前，否则每个 rank 的 NCCL 通信器都会落在 `cuda:0` 上。另外，`timeout` 是显式指定的：如果某个 rank 始终没有加入某次集合通信，到时间后会抛出异常，而不是永远卡死。
#
# ### 用 send 和 recv 实现环形 all-reduce
#
# `send(tensor, dst)` 和 `recv(tensor, src)` 在两个 rank 之间传输一个张量；接收方必须事先分配好形状和 dtype 都正确的张量。其他所有操作都可以用这两者搭出来。环形 all-reduce 把 n 个 rank 排成一个环，把张量切成 n 块，分两个阶段执行：
#
# 1. **reduce-scatter**，共 n-1 步：第 s 步，rank r 把第 (r - s) 块发给右边的邻居，并把从左边收到的第 (r - s - 1) 块累加到自己的对应块上。n-1 步之后，rank r 持有第 (r + 1) 块的完整总和。
# 2. **all-gather**，共 n-1 步：已完成的块沿环再传一圈，每个接收方用它覆盖自己那份过时的副本。
#
# 代码如下，来自 `lessons/collective_workers.py`：

# %%
print(inspect.getsource(cw.exchange))
print(inspect.getsource(cw.ring_all_reduce))

# %% [markdown]
# 每个 rank 同时在发送和接收，所以 `exchange` 用非阻塞的 `isend` 发送：如果所有 rank 都先调用阻塞的 `send`，每个 rank 都可能在等一个同样卡在 `send` 里的邻居，整个环就可能死锁。
#
# 为了看清这两个阶段，把 rank r 的每个元素初值设为 10^r，这样从和的各位数字就能看出加进了哪些 rank（1101 = rank 0、2 和 3）。方格颜色越深，加进来的 rank 越多。`check_ring` 还会在 1000 个随机浮点数和 1000 个随机整数上各跑一遍这个环，并与库函数 `dist.all_reduce` 的结果比较。

# %%
ring = run_workers(cw.check_ring, 4, timeout_s=60)
trace = [[ring[r]["trace"][step] for r in range(4)] for step in range(len(ring[0]["trace"]))]
labels = ["start"] + [f"reduce-scatter {s + 1}" for s in range(3)] + [
    f"all-gather {s + 1}" for s in range(3)]
cw.draw_ranks("ring all-reduce, 4 ranks: what each rank holds after each step",
              [(label, rows, "digits") for label, rows in zip(labels, trace)])
plt.show()

assert len(trace) == 1 + 2 * 3                               # 2(n-1) 步
after_reduce_scatter = trace[3]
for r in range(4):  # 第 1 阶段结束后，rank r 持有完整的第 (r + 1) % n 块……
    assert after_reduce_scatter[r][(r + 1) % 4] == 1111
assert all(torch.equal(row, torch.full((4,), 1111.0, dtype=torch.float64)) for row in trace[-1])
for r, result in enumerate(ring):  # ……完整结果也与库函数的一致
    print(f"rank {r}: max |ring - dist.all_reduce| = {result['max_abs_diff']:.1e} (floats); "
          f"integers identical: {result['ints_equal']}; sent {result['bytes_sent']} B "
          f"of a {result['bytes_total']} B tensor")
    assert result["ints_equal"] and result["max_abs_diff"] <= 1e-5
    assert result["bytes_sent"] == 2 * (4 - 1) / 4 * result["bytes_total"]

# %% [markdown]
# 整数上两者结果完全相同；浮点数上最后几位可能不同：环的累加顺序与库的算法不同，而浮点加法不满足结合律。另外，每个 rank 恰好发送了张量字节数的 2(n-1)/n：每个阶段发送 n-1 个大小为 S/n 的块。
#
# ### 代价模型
#
# 设每一步有固定开销 alpha（发起一条消息的延迟），每个 rank 的发送速率为 B 字节/秒。那么在 n 个 rank 上对 S 字节做环形 all-reduce，耗时为
#
#     t(S) = 2(n-1) * alpha  +  2(n-1)/n * S / B
#
# 小消息的耗时主要是延迟项，大消息主要是带宽项。带宽项几乎不随 n 增长（2(n-1)/n 始终小于 2），这正是环形 all-reduce 能够扩展的原因；延迟项则随 n 线性增长，所以 NCCL 还实现了树形算法（延迟按 log n 增长），并在每次调用时选择算法。
#
# 一次测量能算出两种带宽，定义与 [nccl-tests](https://github.com/NVIDIA/nccl-tests/blob/03a204a1f38aaea17f1a777885bb2d9600ba7eff/doc/PERFORMANCE.md) 相同：
# - **算法带宽** `algbw = S / t`：调用方看到的带宽。对 all-reduce 来说，即使硬件完美，它也会随 n 增大而下降，因为每个 rank 必须传输 2(n-1)/n * S。
# - **总线带宽** `busbw = algbw x factor`，其中 factor 对 all-reduce 是 2(n-1)/n，对 all-gather、reduce-scatter 和 all-to-all 是 (n-1)/n（S 取 gather 之后的完整大小），对 broadcast 和 reduce 是 1。它消除了对 n 的依赖，所以无论 n 是多少，都可以直接与链路的峰值对比。

# %%
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
                "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}
# all-reduce 的系数正好就是上面那个环的发送量（按张量每字节计）：
assert BUSBW_FACTOR["all_reduce"](4) == ring[0]["bytes_sent"] / ring[0]["bytes_total"]
for n in (2, 4, 8, 64):
    print(f"n={n:3d}: all-reduce busbw = algbw x {BUSBW_FACTOR['all_reduce'](n):.3f}")

# %% [markdown]
# ## 使用 PyTorch
#
# ### 逐个演示集合通信（4 个进程）
#
# `run_collectives` 在 4 个 gloo 进程上把每个调用各执行一次。rank r 的初值为 10r, 10r+1, ...：十位数字和颜色都标明这个值来自哪个 rank。灰色方格是多个 rank 的和；带斜线阴影的行表示调用之后内容未定义。每个集合通信都必须由组内的**每一个** rank 调用，顺序相同、形状匹配：这是约定，分布式训练卡死，最常见的原因就是违反了它。

# %%
WORLD_SIZE = 4
results = run_workers(cw.run_collectives, WORLD_SIZE, timeout_s=60)
initial = [cw.rank_values(r, 4) for r in range(WORLD_SIZE)]


def show(name, title, reduced=False):
    before = [results[r][name][0] for r in range(WORLD_SIZE)]
    after = [results[r][name][1] for r in range(WORLD_SIZE)]
    cw.draw_ranks(title, [("before", before, "origin"),
                          ("after", after, "reduced" if reduced else "origin")])
    plt.show()
    return before, after

# %% [markdown]
# **broadcast**：一个 rank（`src`）把自己的张量发给所有 rank。用途：让每个副本都从 rank 0 的权重开始（DDP 包装模型时就会这样做），或者共享配置、随机种子。

# %%
before, after = show("broadcast", "dist.broadcast(x, src=0)")
assert all(torch.equal(a, initial[0]) for a in after)

# %% [markdown]
# **all_reduce**：每个 rank 最终都得到所有 rank 张量逐元素归约的结果，原地写入。`ReduceOp.SUM` 求和；`ReduceOp.AVG` 还会再除以 n，这恰好就是数据并行中的梯度平均。

# %%
total = sum(initial)
before, after = show("all_reduce_sum", "dist.all_reduce(x, op=SUM)", reduced=True)
assert all(torch.equal(a, total) for a in after)
before, after = show("all_reduce_avg", "dist.all_reduce(x, op=AVG)", reduced=True)
assert all(torch.allclose(a, total / WORLD_SIZE) for a in after)

# %% [markdown]
# **reduce**：同样的归约，但只保证 `dst` 拿到结果；之后不要在其他 rank 上读取这个张量（图中带斜线阴影）。适用于只有一个 rank 需要结果的场景，例如要写进日志的 loss。

# %%
before, after = show("reduce", "dist.reduce(x, dst=0, op=SUM)", reduced=True)
assert torch.equal(after[0], total) and after[1:] == [None] * (WORLD_SIZE - 1)

# %% [markdown]
# **all_gather**：每个 rank 贡献一个张量，每个 rank 都按 rank 顺序拿到全部张量。FSDP 在用某一层做计算之前，会先 all-gather 该层的参数分片。

# %%
before, after = show("all_gather", "dist.all_gather(list_of_n, x)")
assert all(torch.equal(a, torch.cat(initial)) for a in after)

# %% [markdown]
# **reduce_scatter**：每个 rank 传入 n 块；rank i 收到所有 rank 第 i 块的归约结果。单独拿出来看，它就是环形 all-reduce 的前半部分，也是 FSDP 的梯度步骤：每个 rank 最终只持有自己负责的那个分片的梯度总和。

# %%
before, after = show("reduce_scatter", "dist.reduce_scatter(out, list_of_n)", reduced=True)
column_sums = torch.stack([cw.rank_values(r, WORLD_SIZE) for r in range(WORLD_SIZE)]).sum(0)
assert all(torch.equal(after[i], column_sums[i:i + 1]) for i in range(WORLD_SIZE))

# %% [markdown]
# **all_to_all**：rank i 把自己的第 j 块发给 rank j，相当于跨 rank 的转置。混合专家（MoE）用它把每个 token 发到持有对应专家的 rank 上。演示调用的是单张量形式 `all_to_all_single`，这类代码实际用的也是它。

# %%
before, after = show("all_to_all", "dist.all_to_all_single(out, x)")
assert all(torch.equal(after[i], torch.stack(before)[:, i]) for i in range(WORLD_SIZE))

# %% [markdown]
# **send / recv**：点对点通信。这里每个 rank 把自己的张量传给右边的邻居（环的基本构件）；流水线则用它把激活值从一个阶段传到下一个阶段。

# %%
before, after = show("send_recv", "isend to rank+1, recv from rank-1")
assert all(torch.equal(after[r], initial[(r - 1) % WORLD_SIZE]) for r in range(WORLD_SIZE))

# %% [markdown]
# **barrier**：不传数据，只是一个集合点：所有 rank 到齐之前，谁都不能离开。这里 rank r 在调用它之前先睡眠 0.3 × r 秒。barrier 要少用（例如在 rank 0 读取其他 rank 写的文件之前）；集合通信本身就会让参与的各个 rank 同步。

# %%
arrived = [results[r]["barrier"]["arrived"] for r in range(WORLD_SIZE)]
left = [results[r]["barrier"]["left"] for r in range(WORLD_SIZE)]
t0 = min(arrived)
fig, ax = plt.subplots(figsize=(5, 1.9))
for r in range(WORLD_SIZE):
    ax.plot([arrived[r] - t0, left[r] - t0], [r, r], "o-", color="C0")
ax.axvline(max(arrived) - t0, color="0.6", ls="--", lw=1)
ax.set(xlabel="seconds", ylabel="rank",
       title="dist.barrier(): arrive (left dot), leave (right dot)")
ax.set_yticks(range(WORLD_SIZE))
ax.invert_yaxis()
plt.tight_layout()
plt.show()
print(f"last arrival after first: {max(arrived) - t0:.3f} s; "
      f"first departure after last arrival: {min(left) - max(arrived):.4f} s")
assert min(left) >= max(arrived)        # 最后一个 rank 到达之前，谁也没有离开

# %% [markdown]
# ### rank 组，以及立即返回的调用
#
# 上面的每次调用都在**默认进程组**上进行，也就是 `init_process_group` 创建的、包含全部 4 个 rank 的那个组。进程组就是一组相互通信的 rank；`dist.new_group(ranks)` 可以再建一个，每个集合通信都接受 `group=` 参数，只在这个组内进行。每个 rank 都必须按相同的顺序创建每一个组，包括自己不在其中的组。后面几课会让每类通信各走一个组：FSDP 的 all-gather 在一组 rank 内进行，张量并行的在另一组内进行。
#
# 其次是 `async_op=True`：调用立即返回一个 `Work` 句柄，集合通信在后台进行，`work.wait()` 会阻塞，直到结果写进张量。在这之间，rank 可以去做计算。DDP 就是这样让 all-reduce 与反向传播重叠的（第 01 课），FSDP 也是这样让 all-gather 与上一个块的计算重叠的（第 02 课和第 06 课）。

# %%
groups = run_workers(cw.groups_and_async, WORLD_SIZE, timeout_s=60)
for r, g in enumerate(groups):
    a = g["async"]
    print(f"rank {r}: group {g['group_ranks']} sums to {g['group_sum']:.0f} | all_reduce of 4 MiB "
          f"returned after {a['issued_s'] * 1e3:.2f} ms, done after {a['done_s'] * 1e3:.1f} ms")
assert [g["group_ranks"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
assert [g["group_sum"] for g in groups] == [1, 1, 5, 5]     # 0 + 1 和 2 + 3：每对各算各的
assert all(g["async"]["sum_ok"] for g in groups)            # wait() 之后结果已就绪

# %% [markdown]
# 这些时间是本机的测量值，只打印，不做断言：笔记本电脑繁忙时，某个 rank 甚至连发出调用都会慢。能保证的是顺序：只有在 `wait()` 之后才能读这个张量。

# %% [markdown]
# ### 列表形式与扁平缓冲区形式
#
# 上面的 `all_gather` 和 `reduce_scatter` 接受由 n 个张量组成的 Python 列表。两者还各有一种扁平缓冲区形式，读写一个 n 倍大小的连续张量，可以省去拷贝，FSDP 用的就是这种形式。在 torch 2.13 中，它们叫 `dist.all_gather_single` 和 `dist.reduce_scatter_single`（旧名字会发出警告；见下面的折叠框）。
#
# <details><summary>版本差异：旧版 torch 有什么不同（读一遍即可，之后可以跳过）</summary>
#
# 本课程在 torch 2.13 上测试。`collective_workers.py` 中的辅助函数如何应对旧版本，依据的是相关 pull request 的合并日期（并没有在这些版本上实际运行过）：
#
# - 扁平形式在 2.13 之前叫 `all_gather_into_tensor` 和 `reduce_scatter_tensor`。在 2.13 中旧名字仍然可用，但会发出 `FutureWarning`（下面有断言检查），而新名字在更早的版本中不存在，所以辅助函数会选用当前存在的那个名字：`getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor`。
# - gloo 在 2025 年 3 月加入了 `ReduceOp.AVG`（pytorch PR #149781）和列表形式的 `reduce_scatter`（PR #149869），按日期推算是从 torch 2.8 开始。`cw.all_reduce_avg` 会回退为 SUM 加一次除法，`cw.reduce_scatter_list` 会回退到扁平形式。（这里说的是调用接口；它实际发送多少字节，见下文的统计。）
# - 在文档的后端支持表中，列表形式的 `dist.all_to_all` 在 gloo 上标为不支持，而 gloo 从哪个版本开始支持它也无法确定，所以本课程在 CPU 上使用 `all_to_all_single`。
#
# all-gather 和 reduce-scatter 的列表形式从未改变过，这也是本课先讲它们的原因。
# </details>

# %%
print("flat all-gather used here:", cw.all_gather_single.__name__,
      "| flat reduce-scatter used here:", cw.reduce_scatter_single.__name__)
flat_after = [results[r]["all_gather_flat"][1] for r in range(WORLD_SIZE)]
assert all(torch.equal(a, torch.cat(initial)) for a in flat_after)       # 与列表形式的结果相同
flat_rs = [results[r]["reduce_scatter_flat"][1] for r in range(WORLD_SIZE)]
assert all(torch.equal(flat_rs[i], column_sums[i:i + 1]) for i in range(WORLD_SIZE))
warned = results[0]["old_name_warnings"]
print("calling dist.all_gather_into_tensor on this torch warned:", warned or "nothing")
if hasattr(torch.distributed, "all_gather_single"):   # torch >= 2.13
    assert any(w.startswith("FutureWarning") and "all_gather_single" in w for w in warned)

# %% [markdown]
# ### gloo 实际发送了多少字节
#
# 代价模型说的是环形算法必须发送多少。Linux 会统计一个进程写出的每个字节，包括写到套接字上的（`/proc/self/io`），所以一次调用前后的差值就是这个 rank 发送的字节数。`bytes_sent_per_collective` 在 4 个 rank 上把每种操作各调用一次（S = 4 MiB），再除以 S：

# %%
sent = run_workers(cw.bytes_sent_per_collective, WORLD_SIZE, timeout_s=60)
n = WORLD_SIZE
if sent[0]["all_reduce"] is None:
    print("not counted: this system has no /proc/self/io (it is Linux's)")
else:
    for name in ("all_reduce", "all_gather", "reduce_scatter"):
        print(f"{name:15s} each rank sent {sent[0][name]:.3f} S | a ring sends "
              f"{BUSBW_FACTOR[name](n):.3f} S")
    for per_rank in sent:  # 误差在 1% 以内：多出的是 gloo 的消息头
        assert abs(per_rank["all_reduce"] / BUSBW_FACTOR["all_reduce"](n) - 1) < 0.01
        assert abs(per_rank["all_gather"] / BUSBW_FACTOR["all_gather"](n) - 1) < 0.01
        # gloo 的 reduce-scatter 与它的 all-reduce 发送量相同：是环形 reduce-scatter 的两倍
        assert abs(per_rank["reduce_scatter"] / per_rank["all_reduce"] - 1) < 0.01
        assert per_rank["reduce_scatter"] > 1.9 * BUSBW_FACTOR["reduce_scatter"](n)

# %% [markdown]
# all-reduce 和 all-gather 发送的字节数与环形算法完全一致。reduce-scatter 不是这样：gloo 两种形式都接受，但底层是先对整个张量做 all-reduce，再留下自己那一块，所以在 gloo 上 **一次 reduce-scatter 的代价等于一次 all-reduce**，是环形 reduce-scatter 字节数的两倍。第 06 课在 CPU 上预测 FSDP 的步耗时时用到了这一点。NCCL 运行的是真正的环形 reduce-scatter，每个 rank 发送 (n-1)/n S（*仅限 GPU，未在 CI 中执行*）。

# %% [markdown]
# ### 后续各课的并行策略如何使用这些操作
#
# | 策略 | 每个 rank 持有什么 | 每个训练步的集合通信 |
# |---|---|---|
# | DDP（第 01 课） | 完整模型，batch 的一部分 | 对梯度做 all-reduce（AVG） |
# | FSDP（第 02 课） | 每个参数的 1/n | 使用前 all-gather 参数，对梯度做 reduce-scatter |
# | TP（第 03 课） | 每个权重矩阵的一部分 | 层内的 all-reduce（行并行），或 all-gather / reduce-scatter（列并行和序列并行） |
# | PP（第 04 课） | 几个完整的层 | 前向 send / recv 激活值，反向 send / recv 梯度 |
#
# `strategy_patterns` 在一个很小的两层 MLP（float64）上手动实现每种策略，并与单进程中的相同计算对比：DDP 的平均梯度、FSDP 的梯度分片（all-gather 权重分片、反向传播、reduce-scatter 梯度）、张量并行 MLP 的输出（第一层列并行、第二层行并行、一次 all-reduce），以及 4 阶段流水线的输出。

# %%
print(inspect.getsource(cw.fsdp_pattern))
diffs = run_workers(cw.strategy_patterns, 4, timeout_s=60)[0]
for name, diff in diffs.items():
    print(f"{name:5s} max |distributed - single process| = {diff:.1e}")
assert set(diffs) == {"DDP", "FSDP", "TP", "PP"} and max(diffs.values()) <= 1e-12

# %% [markdown]
# ## 动手实验：先 torchrun，再做测量
#
# ### torchrun 实际启动了什么
#
# 本课没有单独的实验：`lessons/collective_workers.py` 本身也是一个 torchrun 脚本（和各实验一样，只依赖标准库和 torch）。每个 rank 按各实验的规则选择后端，用 `all_gather_object`（一种集合通信，操作的是 pickle 过的 Python 对象）收集所有 rank 的环境变量，对自己的 rank 编号做 all-reduce，最后由 rank 0 把结果写成 JSON。确切的命令如下：

# %%
out_dir = Path(tempfile.mkdtemp())
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
       str(ROOT / "lessons" / "collective_workers.py"), "--out", str(out_dir / "env.json")]
print("torchrun " + " ".join(cmd[3:]).replace(str(ROOT) + os.sep, ""))
proc = subprocess.run(cmd, check=True, timeout=300, capture_output=True, text=True,
                      env={**os.environ, "OMP_NUM_THREADS": "1"})
print(proc.stdout)
report = json.loads((out_dir / "env.json").read_text())
for r, view in enumerate(report["ranks"]):
    print(f"rank {r}: backend {view['backend']}, device {view['device']}, pid {view['pid']}")
    print("   ", {k: v for k, v in view["env"].items() if v is not None})

# %%
envs = [view["env"] for view in report["ranks"]]
assert [e["RANK"] for e in envs] == ["0", "1"] and [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
assert all(e["WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2" for e in envs)
for key in ["MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"]:   # 共用同一次 rendezvous
    assert envs[0][key] and envs[0][key] == envs[1][key], key
shared_store = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"
assert all(e["TORCHELASTIC_USE_AGENT_STORE"] == str(shared_store) for e in envs)
assert report["sum_of_ranks"] == 0 + 1
expected_backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"   # 实验选后端的规则
assert all(view["backend"] == expected_backend for view in report["ranks"])

# %% [markdown]
# `--standalone` 在本机选了一个空闲端口，并自己运行 rendezvous；`TORCHELASTIC_RUN_ID` 是这次 rendezvous 的名字（多节点时，`--rdzv-id` 必须在所有节点上相同）。`TORCHELASTIC_USE_AGENT_STORE=True` 表示各 rank 会合所用的 store 由 torchrun 自己的进程（它的“agent”）托管，而不是由 rank 0 托管。多出来的 `GROUP_RANK` 和 `ROLE_*` 变量也来自这个 agent；脚本很少需要用到它们。
#
# ### 本机上的耗时与消息大小
#
# 现在用真实测量来检验代价模型：在 2 个 gloo 进程上对 float32 张量执行 `dist.all_reduce`，大小从 1 KiB 到 16 MiB。每个点取 25 个短计时窗口中最快的一个；每个窗口连续调用若干次、总共持续约 2 ms，取最慢 rank 的平均耗时，不同大小交替测量。之所以取最快的，是因为这台机器是共享的：慢的窗口测到的是别的程序，而不是集合通信本身。
#
# 用最小二乘拟合 alpha-beta 模型 t(S) = a + b * S，按 1/t 加权，让 1 KiB 的点和 16 MiB 的点分量相同（不加权的话，最大的几个耗时说了算，估出来的延迟就只剩噪声）。代入环形算法的公式，a = 2(n-1) * alpha，b = 2(n-1) / (n * B)，所以总线带宽为 2(n-1)/n / b。

# %%
n = 2
sizes = [2 ** k for k in range(10, 25)]
timing = run_workers(cw.time_all_reduce, n, sizes, timeout_s=120)[0]
S = np.array([s for s, _ in timing], dtype=float)
t = np.array([seconds for _, seconds in timing])
A = np.stack([1 / t, S / t], axis=1)            # 每一行对应 (a + b*S) / t = 1
(a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
print(f"latency term a = {a * 1e6:.1f} us, bandwidth term b = 1 / ({1 / b / 1e9:.2f} GB/s)")
assert a > 0 and b > 0, (a, b)
model = a + b * S
r2 = 1 - np.sum(np.log(t / model) ** 2) / np.sum((np.log(t) - np.log(t).mean()) ** 2)
busbw_fit = BUSBW_FACTOR["all_reduce"](n) / b    # 字节/秒
algbw = S / t
busbw = algbw * BUSBW_FACTOR["all_reduce"](n)
print(f"R^2 (log time) = {r2:.3f}; bus bandwidth from the fit = {busbw_fit / 1e9:.2f} GB/s; "
      f"the two terms are equal at S = a/b = {a / b / 1024:.0f} KiB")
assert r2 > 0.7, r2    # a + b * S 解释了 log(time) 的大部分变化

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
ax1.loglog(S, t * 1e6, "o", label="measured (gloo, 2 processes)")
grid = np.geomspace(S[0], S[-1], 100)
ax1.loglog(grid, (a + b * grid) * 1e6, "-",
           label=f"fit: {a * 1e6:.0f} us + S / {1 / b / 1e9:.2f} GB/s")
ax1.set(xlabel="message size S (bytes)", ylabel="time per all_reduce (us)", title="time vs size")
ax1.legend(fontsize=7)
ax2.semilogx(S, busbw / 1e9, "o", label="busbw = algbw x 2(n-1)/n")
ax2.semilogx(grid, BUSBW_FACTOR["all_reduce"](n) * grid / (a + b * grid) / 1e9, "-", label="model")
ax2.axhline(busbw_fit / 1e9, color="0.6", ls="--", lw=1, label="fitted bus bandwidth")
ax2.set(xlabel="message size S (bytes)", ylabel="GB/s", title="bus bandwidth vs size")
ax2.legend(fontsize=7)
plt.tight_layout()
plt.show()
# 小消息受延迟限制，远低于拟合出的带宽；大消息则接近它。
assert busbw[0] < 0.5 * busbw_fit and busbw[-1] > busbw[0]

# %% [markdown]
# 从左往右看左图：延迟项占主导时曲线是平的，之后变成斜率为 1 的直线，耗时随大小增长。右图是同一组数据换算成的带宽：极小的消息只用到了机器传输能力的一小部分，所以 DDP 把梯度打包成几 MB 一个的桶，而不是把每个参数的梯度单独发出去。
#
# 拟合能预测得多准，全看这两个数字。每个 rank 的带宽不变时，调用方看到的算法带宽随 n 下降，总线带宽则保持不变：

# %%
for ranks in (2, 4, 8, 64):
    predicted_algbw = busbw_fit / BUSBW_FACTOR["all_reduce"](ranks)
    print(f"n={ranks:3d}: busbw {busbw_fit / 1e9:.2f} GB/s -> "
          f"algbw {predicted_algbw / 1e9:.2f} GB/s")
assert busbw_fit / BUSBW_FACTOR["all_reduce"](64) < busbw_fit / BUSBW_FACTOR["all_reduce"](2)
seconds_4gb = a + b * grad_bytes
print(f"one all-reduce of the 4 GB of gradients from 'Why', 2 processes on this machine: "
      f"{seconds_4gb:.1f} s (model prediction)")
assert seconds_4gb > b * grad_bytes > 0

# %% [markdown]
# 这些数字是 gloo 在一台 CPU 主机上用多个进程测的，这里的“链路”其实是经由内核回环 TCP 的内存拷贝。到了 GPU 上，用同样的方法（或者用 nccl-tests）测 NCCL，把总线带宽和 NVLink 或网络的峰值比一比；这个两项模型同样适用。
#
# ## 小结
#
# - 分布式作业就是 N 个独立的进程。torchrun 给每个进程设置 `RANK`、`LOCAL_RANK`、`WORLD_SIZE` 和 rendezvous 地址；`init_process_group` 通过该地址上的 TCPStore 与其他进程会合，然后由后端（CUDA 用 NCCL，CPU 用 gloo）在它们之间建立直连。
# - 集合通信由组内每个 rank 调用，顺序相同、形状匹配。broadcast、all_reduce（SUM / AVG）、reduce、all_gather、reduce_scatter、all_to_all、send / recv 和 barrier 涵盖了本课程用到的全部操作。
# - all-reduce = reduce-scatter + all-gather。环形版本每个 rank 传输 2(n-1)/n * S，因此带宽开销几乎与 n 无关；延迟开销则随 n 增长。
# - 耗时 = 延迟 + 大小 / 带宽。总线带宽（nccl-tests）消除了算法带宽对 n 的依赖，因此可以直接与硬件峰值对比。
# - DDP = 梯度 all-reduce；FSDP = all-gather + reduce-scatter；TP = 层内集合通信；PP = 阶段之间的 send / recv。
#
# ## 练习
#
# 下面每道练习都收在[入门练习](../docs/onboarding-exercises.md)里，配有一段自查代码（你的答案必须通过的一段 Python）和一份折叠起来的参考答案。
#
# 1. **环形 all-reduce 发送的字节数**：n 不能整除张量时，`ring_all_reduce` 中每个 rank 发送的确切字节数（[入门练习](../docs/onboarding-exercises.md#exercise-01-bytes-sent-by-a-ring-all-reduce)中的练习 0.1）。
# 2. **算法带宽与总线带宽**：根据 `comm_bench` 测得的总线带宽，算出 2 个和 8 个 rank 上一次 all-reduce 的耗时和带宽（[入门练习](../docs/onboarding-exercises.md#exercise-02-algorithm-and-bus-bandwidth)中的练习 0.2）。
# 3. **张量并行发送什么，DDP 发送什么**：`tp_pattern` 和 `ddp_pattern` 中那次 all-reduce 各发送多少字节，以及 batch 多大时两者相等（[入门练习](../docs/onboarding-exercises.md#exercise-03-what-tensor-parallel-sends-and-what-ddp-sends)中的练习 0.3）。
#
# ## 出问题时
#
# - 某个单元停在 `run_workers` 上，然后抛出 `TimeoutError`：有一个 rank 没有加入某次集合通信（某个 rank 上调用的顺序或次数不同），或者它先挂掉了；超时把卡死变成了报错。卡死和超时在排障手册（[排障手册索引](../runbooks/index.md)）里有详细讲解。
# - 报 `RuntimeError`，说尺寸不匹配：传给集合通信的张量在每个 rank 上必须具有相同的形状和 dtype（`recv` 的缓冲区也一样）。
# - 报错说 gloo 不支持 `reduce_scatter` 或 `ReduceOp.AVG`：torch 版本低于 2.8。这里的辅助函数会自动回退（`cw.GLOO_HAS_AVG_AND_REDUCE_SCATTER`）；你自己的代码也必须这样做，或者改用 NCCL。
