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
# # 01 · DistributedDataParallel
#
# 学完本课，你将能够：
#
# - 准确说出 DDP 通信什么、什么时候通信、通信多少；
# - 用一次集合通信手动平均梯度，并证明 DDP 做的是同一件事；
# - 把单进程训练脚本改成 DDP 脚本：一共五处改动，对照 diff 逐条看；
# - 在 1、2 或 4 个进程上运行 `labs/lab01_ddp.py`，并证明它训练出的模型与单进程训练的相同，误差在 1e-5 以内；
# - 根据 `bucket_cap_mb` 和 `no_sync()` 预测每一步会发起多少次 all-reduce。
#
# 下面的一切都能在笔记本电脑的 CPU 上运行：进程之间通过 127.0.0.1 上的 gloo 通信。换到 GPU 上，同样的代码改用 NCCL。

# %%
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

ROOT = Path(os.environ.get("COURSE_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "labs" / "lab01_ddp.py").exists()))
sys.path.insert(0, str(ROOT / "lessons"))
sys.path.insert(0, str(ROOT / "labs"))

import ddp_workers  # noqa: E402  （worker 函数放在模块里：spawn 会重新导入它们）
import lab01_ddp as lab  # noqa: E402  （实验可以直接导入：导入时什么都不执行）
from spawn import run_workers  # noqa: E402

# %% [markdown]
# ## 为什么
#
# 一个进程只能使用一个设备。`torch.nn.DataParallel` 曾试图用单个 Python 进程驱动多块 GPU：它每一步都要把模型复制到每块 GPU 上，把所有输出收集到 GPU 0，还要和 GIL 争抢。结果 GPU 0 成了瓶颈。**DistributedDataParallel（DDP）** 的做法是每个设备一个进程。每个进程（称为一个 *rank*，即进程编号）持有一份完整的模型副本，读取每个 batch 中不同的一部分；`backward()` 之后，各 rank 对梯度做 **all-reduce**，于是每份副本都执行完全相同的更新。
#
# 通信量有多大？每一步，每个 rank 发送和接收的数据量约为梯度字节数的 2(n-1)/n 倍（环形 all-reduce）。以本实验的小模型为例：

# %%
cfg = lab.parse_config([])
model = lab.build_model(cfg)
num_params = sum(p.numel() for p in model.parameters())
grad_bytes = num_params * 4  # fp32 梯度
for world_size in (2, 4, 8):
    sent = 2 * (world_size - 1) / world_size * grad_bytes
    print(f"world size {world_size}: {num_params:,} params -> {sent / 1e6:.2f} MB per rank per step")
assert num_params == 139_584

# %% [markdown]
# 同样的算式放到大模型上：一个 1B 参数的 fp32 模型，在 16 个 rank 上每个 rank 每步要传输约 7.5 GB。DDP 能把其中大部分藏在反向传播后面（见下文），真正卡脖子的是显存：每个 rank 都完整持有参数、梯度和优化器状态（fp32 下用 Adam，每个参数约 16 字节），这正是 FSDP（第 02 课）要解决的问题。
#
# ## 从零开始：自己动手平均梯度
#
# 两个进程各有一份模型（初始权重相同）；一个 batch 有 16 条序列，两个进程各对自己那一半做反向传播。然后做一次集合通信 `all_reduce(SUM)`，再除以 world size。worker 函数拿结果和两样东西比：DDP 在同样两半数据上的结果，以及单个进程对整个 batch 做反向传播的结果。

# %%
import inspect  # noqa: E402

print(inspect.getsource(ddp_workers.average_gradients_by_hand))

# %%
by_hand = run_workers(ddp_workers.average_gradients_by_hand, 2)
for rank, result in enumerate(by_hand):
    print(f"rank {rank}: |manual - DDP| = {result['manual_vs_ddp']:.1e}, "
          f"|manual - whole batch| = {result['manual_vs_whole_batch']:.1e}")
assert all(r["manual_vs_ddp"] == 0.0 for r in by_hand)  # DDP 做的正是这个求和
assert all(r["manual_vs_whole_batch"] < 1e-6 for r in by_hand)  # = 整个 batch 的梯度

# %% [markdown]
# 结果与 DDP 逐位相同，与整个 batch 的梯度只差浮点舍入（约 1e-8）：因为两半大小相同，两个半 batch 均值的平均值*就是*整个 batch 的均值。数据并行说到底就是这个道理。
#
# ## 使用 PyTorch：看 diff
#
# `lessons/train_plain.py` 是一个约 40 行的普通单进程训练循环，`lessons/train_ddp.py` 是同一个脚本的 DDP 版本。两者的全部差异如下：

# %%
import difflib  # noqa: E402

plain, ddp = (ROOT / "lessons" / name for name in ("train_plain.py", "train_ddp.py"))
diff = list(difflib.unified_diff(plain.read_text().splitlines(), ddp.read_text().splitlines(),
                                 "train_plain.py", "train_ddp.py", lineterm="", n=1))
print("\n".join(diff))
changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
assert len(plain.read_text().splitlines()) < 50 and len(changed) < 35  # 含 docstring

# %% [markdown]
# 撇开 docstring 不谈，可以把它看成五处改动：
#
# 1. **创建进程组**，并显式指定超时，这样对端卡住时会报错，而不是一直卡死（GPU 上：先调用 `torch.cuda.set_device(local_rank)`，再使用 `nccl`）。
# 2. **用 `DistributedDataParallel` 包装模型**：它先把 rank 0 的权重 broadcast 给所有 rank，然后在 `backward()` 期间对梯度做 all-reduce。
# 3. **让每个 rank 读不同的数据**：使用 `DistributedSampler`，每个 rank 的 batch size 为 `BATCH // world_size`，并在每个 epoch 调用 `set_epoch(epoch)`（不调用的话，每个 epoch 都会重复第一个 epoch 的顺序，见[每个 epoch 顺序相同](../runbooks/dataloader-same-order-every-epoch.md)）。
# 4. **只在 rank 0 上打印和保存**，保存的是 `model.module`，这样键名不会带 `module.` 前缀。
# 5. **训练结束时销毁进程组**（`dist.destroy_process_group()`），让每个 rank 都干净地退出作业。
#
# <details><summary>为什么脚本在 main() 之外创建和销毁进程组</summary>
#
# DDP 模型持有进程组。如果销毁进程组时模型还活着，gloo 的 rank 退出时可能报 `terminate called without an active exception` 并中止。所以模型只存在于 `main()` 之内，它返回之后、销毁进程组之前再调用 `gc.collect()`（引用环可能让模型一直存活；不调用它时，这里 12 次运行中仍有 2 次中止）。[退出时卡死，原因 D](../runbooks/exit-hang.md) 里有对应的演练。
# </details>
#
# 下面把两个脚本都实际跑一遍：一个进程处理整个 batch，两个 DDP rank 各处理一半。

# %%
diff_dir = Path(tempfile.mkdtemp(prefix="lesson01-diff-"))
for label, command in (("one process", [str(plain)]),
                       ("DDP, 2 ranks", ["-m", "torch.distributed.run", "--standalone",
                                         "--nproc-per-node", "2", str(ddp)])):
    out = diff_dir / ("plain.pt" if label == "one process" else "ddp.pt")
    proc = subprocess.run([sys.executable, *command, str(out)], check=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True)
    print(f"{label}: " + " | ".join(proc.stdout.split("\n")[:-1]))
plain_state = torch.load(diff_dir / "plain.pt", weights_only=True)
ddp_state = torch.load(diff_dir / "ddp.pt", weights_only=True)
script_parity = max((plain_state[k] - ddp_state[k]).abs().max().item() for k in plain_state)
print(f"max |param diff| after 3 epochs: {script_parity:.1e}")
assert plain_state.keys() == ddp_state.keys() and script_parity <= 1e-5

# %% [markdown]
# 得到的是同一个模型，差异只在舍入误差范围内：两个半 batch 梯度的平均值就是整个 batch 的梯度。数据顺序也一致，因为 `DistributedSampler(seed=0)` 和普通脚本的 `RandomSampler` 在每个 epoch 抽出的 `randperm` 相同，而 DDP 的 rank r 从中每隔 `world_size` 个索引取一个。
#
# 实验脚本做的是同样的事，再加上长时间训练作业需要的东西：梯度累积（除最后一个微步外都用 `no_sync()`，即实验里的 `gradient_sync`，工具包的 `train_step` 会在每个微步外面套上它）、检查点、日志和故障处理。（它的 `init_distributed()` 还会建一个重启也不出问题的 store，原因见[重启后卡死](../runbooks/restart-hang.md)。）

# %%
print(inspect.getsource(lab.apply_ddp))
print(inspect.getsource(lab.gradient_sync))
print(inspect.getsource(lab.train_step))  # 来自工具包：labs/labkit/loop.py

# %% [markdown]
# ## 桶与 no_sync：数一数 all-reduce 的次数
#
# DDP 不会等整个反向传播结束。它按反向传播产生梯度的顺序，把梯度分进大小约为 `bucket_cap_mb` 的**桶**，每个桶一满就立即为它发起一次 all-reduce，同时反向传播继续计算更靠前的层。桶达到上限就封口，而且单个参数不会被拆开，所以除最后一个桶外，每个桶至少有 `bucket_cap_mb`，最多是上限再加一个参数。
#
# 有一个例外：当 `bucket_cap_mb` 保持默认值（`None`，即 25 MiB）时，第一个桶，也就是反向传播中最先发起 all-reduce 的那个桶，上限是 `dist._DEFAULT_FIRST_BUCKET_BYTES` = 1 MiB，为的是让通信尽早开始。显式传入 `bucket_cap_mb=25`，则每个桶都是 25 MiB。本实验显式传入 `--bucket-cap-mb`（默认 25），所以下面的计数遵循普通规则。
#
# worker 注册了一个通信 hook（标准的 all-reduce，外加一个计数器），优化器每更新一次跑 4 个微步。

# %%
largest_param_bytes = max(p.numel() for p in model.parameters()) * 4
bucket_runs = {}
for cap_mb in (0.05, 0.25, 25.0):
    result = run_workers(ddp_workers.count_buckets, 2, cap_mb, 4, False, 10)[0]
    bucket_runs[cap_mb] = result
    cap_bytes = cap_mb * 2**20
    per_backward = round(result["allreduce_calls_per_step"] / 4)
    print(f"bucket_cap_mb={cap_mb:<5}: {per_backward} all-reduces per backward, "
          f"{result['allreduce_calls_per_step']:.0f} per optimizer step, "
          f"{result['ms_per_step']:.0f} ms/step")
    assert per_backward <= math.ceil(grad_bytes / cap_bytes)
    assert per_backward >= math.floor(grad_bytes / (cap_bytes + largest_param_bytes))

# %% [markdown]
# 这个例外的实测结果：本实验的模型取宽度 256（fp32 梯度共 8.5 MB），在 DDP 重建桶之后做一次反向传播，分别使用 DDP 的默认上限和显式给出的 `bucket_cap_mb=25`。

# %%
caps = run_workers(ddp_workers.bucket_sizes_default_vs_explicit_cap, 2)[0]
for label, sizes in caps["sizes"].items():
    print(f"bucket_cap_mb {label:<11}: all-reduces of {', '.join(f'{b:,}' for b in sizes)} bytes")
first_cap = caps["first_bucket_cap"]
assert first_cap == 2**20
default, explicit = caps["sizes"]["default"], caps["sizes"]["explicit 25"]
assert len(default) == 2 and len(explicit) == 1 and sum(default) == sum(explicit)
# 第一个桶一到 1 MiB 就封口：最多比它多出一个参数。
largest_param_256 = 256 * 4 * 256 * 4  # 宽度 256 时的 w1 或 w3：1 MiB 的 fp32
assert first_cap <= default[0] < first_cap + largest_param_256

# %% [markdown]
# 现在同样跑 4 个微步，前三个放在 `no_sync()` 里：梯度在本地累积，只有最后一次反向传播才发出各个桶的通信。

# %%
no_sync = run_workers(ddp_workers.count_buckets, 2, 0.05, 4, True, 10)[0]
synced = bucket_runs[0.05]
print(f"without no_sync: {synced['allreduce_calls_per_step']:.0f} all-reduces/step, "
      f"{synced['ms_per_step']:.0f} ms/step")
print(f"with no_sync:    {no_sync['allreduce_calls_per_step']:.0f} all-reduces/step, "
      f"{no_sync['ms_per_step']:.0f} ms/step")
assert no_sync["allreduce_calls_per_step"] * 4 == synced["allreduce_calls_per_step"]

# %% [markdown]
# 次数是精确的；时间则是在跑本页的那台机器上如实测的（这里是两个 CPU 进程共用几个核，细小的差异不必当真）。在 GPU 上，通信在独立的 stream 上执行，真正与反向传播重叠；而在这种只有 CPU 的 gloo 环境里，计算和通信争抢同样的核心。计数时跳过了第一步：DDP 用它来记录梯度就绪的顺序，然后按这个顺序重建桶。
#
# ## 运行实验
#
# `labs/lab01_ddp.py` 是可以直接复制去用的版本：按执行顺序把 DDP 的各个环节写出来（进程组、采样器、包装、`no_sync`、由 rank 0 保存检查点），底下用的是同目录的实验工具包（`labs/labkit/`：模型、数据、训练循环及其日志、指标、单进程参考）。加上 `--check-parity` 在两个进程上运行它：训练结束后，rank 0 会在单个进程中用相同的全局 batch 重新训练一遍，并逐个比较所有参数。

# %%
workdir = Path(tempfile.mkdtemp(prefix="lesson01-"))
env = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_lab(nproc, *args):
    metrics_path = workdir / f"metrics-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), str(ROOT / "labs" / "lab01_ddp.py"),
           "--metrics-out", str(metrics_path), *args]
    print("$", " ".join(cmd[2:]))
    proc = subprocess.run(cmd, check=True, timeout=300, env=env, capture_output=True, text=True)
    print(proc.stdout)
    return json.loads(metrics_path.read_text())


ddp2 = run_lab(2, "--check-parity")
assert ddp2["parity_max_abs_diff"] <= 1e-5

# %% [markdown]
# 看最后一行就够了：两个进程训练出的模型与单进程训练的相同，差异在浮点舍入误差以内。下面是两条 loss 曲线。

# %%
steps = [s for s, _ in ddp2["losses"]]
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(steps, ddp2["reference_losses"], lw=4, alpha=0.4, label="single process (reference)")
ax.plot(steps, [loss for _, loss in ddp2["losses"]], "k--", lw=1.2, label="DDP, 2 ranks")
ax.axhline(math.log(cfg.vocab_size), color="gray", lw=0.8, ls=":", label="ln(vocab): chance")
ax.set_xlabel("optimizer step")
ax.set_ylabel("loss")
ax.legend()
ax.set_title(f"They overlap: max |param diff| = {ddp2['parity_max_abs_diff']:.1e}")
plt.show()
gap = max(abs(a - b) for (_, a), b in zip(ddp2["losses"], ddp2["reference_losses"]))
assert gap < 1e-5 and ddp2["final_loss"] < 1.0

# %% [markdown]
# 这个单进程参考有个细节值得注意。它在一个进程中累积每个 rank 各个微批次的梯度，这恰好就是全局 batch 的平均梯度；把 16 条序列当作一个大 batch，算出的是同一个均值，只是求和顺序不同，相差约 1e-8。在 AdamW 的第一步，这样的舍入误差可能让一个权重移动整整一步，所以各实验都对学习率做预热：不预热时，3 个 rank 就达不到 1e-5（实测 1.4e-5，见 `tests/test_odd_world_sizes.py`）。为什么会这样，[第 03 课：fp32 一致性为什么需要预热](03_tp_fsdp.ipynb#why-fp32-parity-needs-warmup-adamws-first-step)做了实测。
#
# 在 4 个进程上使用梯度累积（优化器每更新一次有 2 个微步，第一个使用 `no_sync`），结果也一样。本实验默认的全局 batch 是每个 rank、每个微步 8 条序列，因此会随 world size 增大；用 `--batch-size 16` 可以让它与 2 个 rank 时的全局 batch 保持一致：

# %%
ddp4 = run_lab(4, "--check-parity", "--grad-accum", "2", "--batch-size", "16")
print(f"4 ranks x 2 micro-steps: final loss {ddp4['final_loss']:.4f}, "
      f"parity {ddp4['parity_max_abs_diff']:.1e}")
assert ddp4["parity_max_abs_diff"] <= 1e-5
assert abs(ddp4["final_loss"] - ddp2["final_loss"]) < 1e-4

# %% [markdown]
# ## DDP 用户会遇到的问题
#
# 上面的训练循环碰不到、真实模型却会碰到的问题有五个。除非另有注明，每个都在这里用两个 gloo 进程实际跑一遍（`lessons/ddp_workers.py`）。
#
# ### 得不到梯度的参数
#
# 每次反向传播，DDP 都要等到每个参数的梯度。前向从不使用的分支（冻结的输出头、依赖输入的 `if`）永远交不出梯度，于是*下一次*前向会失败。`find_unused_parameters=True` 让 DDP 在每次前向之后遍历 autograd 图，把这类参数标记为就绪（每步都有 CPU 开销，所以只在需要时开启）：

# %%
broken = run_workers(ddp_workers.unused_parameters, 2, False)[0]
named = run_workers(ddp_workers.unused_parameters, 2, False, True)[0]
fixed = run_workers(ddp_workers.unused_parameters, 2, True)[0]
print("without find_unused_parameters:", broken["error"][:110], "...")
print("with TORCH_DISTRIBUTED_DEBUG=DETAIL the error adds:", named["named"])
print("with find_unused_parameters=True:", fixed["error"] or "two steps, no error")
assert broken["error"].startswith("Expected to have finished reduction in the prior iteration")
assert named["named"] == "Parameters which did not receive grad for rank 0: unused.bias, unused.weight"
assert fixed["error"] is None

# %% [markdown]
# ### BatchNorm 统计量各自漂移
#
# buffer（缓冲区）不是梯度：DDP 从不对它们做 all-reduce。默认情况下，DDP 在每次前向开始时把 rank 0 的 buffer 复制到所有 rank（`forward_sync_buffers=True`，在 torch 2.13 之前叫 `broadcast_buffers`，现在使用旧名字会发出警告）。所以各 rank 在每次前向开始时是一致的，随后各自用自己的数据更新滑动统计量，而 rank 0 保存的检查点只包含 rank 0 那份数据的统计量。如果关掉这个选项，各 rank 之间的差距会一步比一步大。这里两个 rank 看到的数据均值不同：

# %%
for sync in (True, False):
    result = run_workers(ddp_workers.batchnorm_buffers, 2, sync)[0]
    means = result["running_mean_per_rank"]
    print(f"forward_sync_buffers={sync!s:5}: running_mean rank 0 {means[0].numpy().round(3)}, "
          f"rank 1 {means[1].numpy().round(3)}")
    if sync:
        gap_synced = (means[0] - means[1]).abs().max().item()
    else:
        gap_drifted = (means[0] - means[1]).abs().max().item()
print(f"rank gap after 3 steps: {gap_synced:.3f} synced at each forward, {gap_drifted:.3f} not")
assert 0 < gap_synced < gap_drifted
assert result["sync_by_hand_vs_whole_batch"] < 1e-6

# %% [markdown]
# 归一化一个全局 batch，*应该*用它在所有 rank 样本上的均值。手动实现的话，就是对每个 rank 的 batch 均值做一次 all-reduce（方差同理），结果与单进程在整个 batch 上的计算在舍入误差内一致（上面已经断言）。`torch.nn.SyncBatchNorm` 在前向中做的正是这件事；在用 DDP 包装模型之前，先用 `nn.SyncBatchNorm.convert_sync_batchnorm(model)` 转换模型。它只能在 GPU 上运行：在 CPU 上，它的前向会抛出 `SyncBatchNorm expected input tensor to be on GPU or XPU or
# privateuseone`，所以下一个单元只在有 GPU 的环境中运行。

# %%
if torch.cuda.is_available():  # 仅限 GPU，CI 中不执行（这台机器没有 GPU）
    sync_bn = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))).cuda()
    print(type(sync_bn[1]).__name__, "on", next(sync_bn.parameters()).device)
else:
    with_cpu_input = torch.nn.SyncBatchNorm(4).train()
    try:
        with_cpu_input(torch.randn(8, 4))
    except ValueError as exc:
        print("on CPU:", exc)
        assert "expected input tensor to be on GPU" in str(exc)

# %% [markdown]
# ### 输入不均匀与 Join
#
# 如果各 rank 跑的 batch 数不同（按文件切分的 `IterableDataset`、自定义 sampler），batch 多的 rank 会卡在一次 all-reduce 里，而其他 rank 永远不会发起这次 all-reduce。这里 rank 0 有 3 个 batch，rank 1 有 5 个。没有 `Join` 时，rank 0 一退出，rank 1 就会在第 4 个 batch 失败（如果 rank 0 还活着，则在超时后失败）。在 `with Join([model]):` 内部，数据用完的 rank 会一直用零响应其他 rank 的 all-reduce，直到所有 rank 都结束：

# %%
without = run_workers(ddp_workers.uneven_inputs, 2, False, timeout_s=10)
joined = run_workers(ddp_workers.uneven_inputs, 2, True)
for name, ranks in (("without Join", without), ("with Join", joined)):
    print(f"{name:12s}: steps per rank {[r['steps'] for r in ranks]}, "
          f"errors {[r['error'][:60] + '...' if r['error'] else None for r in ranks]}")
assert without[1]["steps"] == 3 and without[1]["error"] is not None
assert [r["steps"] for r in joined] == [3, 5] and not any(r["error"] for r in joined)

# %% [markdown]
# （使用默认的 `DistributedSampler` 时不会出现这种情况：它会补齐数据，让每个 rank 分到相同数量的 batch。）
#
# ### 压缩梯度：通信 hook
#
# `model.register_comm_hook(state, hook)` 可以替换 DDP 对每个桶的处理方式。`torch.distributed.algorithms.ddp_comm_hooks.default_hooks` 中的标准 hook 包括 `fp16_compress_hook` 和 `bf16_compress_hook`：对桶的 16 位副本做 all-reduce，再把求和结果转换回原来的类型。网络上传输的字节数减半，代价是梯度和带上了 16 位的舍入误差。`bf16_compress_hook` 不支持 gloo（`BF16 all reduce communication hook required CUDA
# 11+ and NCCL 2.10+`，仅限 GPU），所以在 CPU 上用 fp16 hook 演示同样的机制：

# %%
fp32 = run_workers(ddp_workers.compressed_allreduce_bytes, 2, "allreduce")[0]
fp16 = run_workers(ddp_workers.compressed_allreduce_bytes, 2, "fp16")[0]
for name, r in (("stock hook", fp32), ("fp16_compress_hook", fp16)):
    print(f"{name:18s}: all_reduce of {sum(b for _, b in r['sent']):,} bytes as "
          f"{sorted({d for d, _ in r['sent']})}")
assert sum(b for _, b in fp32["sent"]) == fp32["grad_bytes"]
assert sum(b for _, b in fp16["sent"]) * 2 == fp16["grad_bytes"]
assert {d for d, _ in fp16["sent"]} == {"torch.float16"}

# %% [markdown]
# ### DataParallel 不是捷径
#
# `torch.nn.DataParallel(model)` 用一个 Python 进程驱动所有 GPU。每一步，它都要把参数从 GPU 0 复制到其他 GPU，把 batch 切开分发出去，在多个线程中运行各个副本（这些线程共享 GIL），再把输出收集回 GPU 0，loss 也由 GPU 0 计算。GPU 0 上放的东西比其他 GPU 多，于是成为瓶颈；PyTorch 文档建议即使在单机上也使用 DDP。DDP 每块 GPU 一个进程，没有这些问题。下面的单元在有两块 GPU 的环境中，分别测这两种方式跑一步的耗时（仅限 GPU，CI 中不执行：在有人用 GPU 跑过之前，本页没有这组数字）：

# %%
if torch.cuda.device_count() >= 2:  # 仅限 GPU，CI 中不执行
    import time as _time

    gpu_model = lab.build_model(cfg).cuda()
    dp_model = torch.nn.DataParallel(gpu_model)
    tokens = torch.randint(0, cfg.vocab_size, (64, cfg.seq_len), device="cuda")
    for label, net in (("one GPU", gpu_model), ("DataParallel", dp_model)):
        for attempt in range(3):  # 第一次调用用于预热
            torch.cuda.synchronize()
            t0 = _time.perf_counter()
            net(tokens).float().mean().backward()
            torch.cuda.synchronize()
        print(f"{label}: {(_time.perf_counter() - t0) * 1e3:.1f} ms per step")
else:
    print("GPU only: needs 2 CUDA GPUs; not executed here")

# %% [markdown]
# ## 小结
#
# - DDP = 每个设备一个进程 + 每个进程一份完整副本 + 梯度 all-reduce。
# - all-reduce 之后的梯度就是全局 batch 的梯度，所以 N 个 rank 训练出的模型，与单进程用 N 倍 batch 训练出的相同：这里实测误差在 1e-5 以内。
# - DDP 把梯度分桶（`bucket_cap_mb`），每个桶一就绪就立即发起它的 all-reduce；`no_sync()` 在梯度累积的微步上跳过 all-reduce。
# - 显存不会随 rank 增多而减少：每个 rank 都持有全部内容。第 02 课（FSDP）解决这个问题。
#
# ## 练习
#
# - **带评分：** 手写 DDP（广播、梯度钩子、与反向传播重叠的分桶）。填写 `exercises/ddp.py`，然后运行 `python exercises/grade.py ddp`：评分脚本会逐项把你的代码与单进程的结果对比（[练习](../exercises/README.md)）。
#
# 下面每道练习都收在[入门练习](../docs/onboarding-exercises.md)里，配有一段自查代码（你的答案必须通过的一段 Python）和一份折叠起来的参考答案。
#
# 1. **预测 DDP 的桶**：给定 `--bucket-cap-mb`，DDP 做 all-reduce 的各个桶有多大，与 DDP 自己的分桶对照（[入门练习](../docs/onboarding-exercises.md#exercise-11-predict-ddps-buckets)中的练习 1.1）。
# 2. **每个 rank 读哪些样本**：调用 `set_epoch` 之后 `DistributedSampler` 分给每个 rank 的样本，以及会不会有 rank 先把数据用完（[入门练习](../docs/onboarding-exercises.md#exercise-12-which-samples-each-rank-reads)中的练习 1.2）。
# 3. **从 epoch 中途断点续训**：lab01 从检查点断点续训时，一个 rank 读到的第一个微批次（[入门练习](../docs/onboarding-exercises.md#exercise-13-resume-mid-epoch)中的练习 1.3）。
#
# ## 出问题时
#
# - 启动时或在某次集合通信中卡死：见[排障手册索引](../runbooks/index.md)。
# - 显存不足：每个 rank 都持有完整模型；请从[排障手册索引](../runbooks/index.md)找到 OOM 相关的条目，并参考第 02 课。
# - 一个 rank 很慢，其他 rank 超时：通常是数据加载的问题；实验的日志行会显示每步等待数据的时间占比（`data N%`）。
