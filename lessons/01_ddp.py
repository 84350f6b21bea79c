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
# After this lesson you can:
#
# - say exactly what DDP communicates, when, and how much;
# - average gradients by hand with one collective and show DDP does the same thing;
# - turn a single-process training script into a DDP one (five changes);
# - run `labs/lab01_ddp.py` on 1, 2 or 4 processes and prove, to 1e-5, that it trains the same
#   model a single process would;
# - predict how many all-reduces a step launches from `bucket_cap_mb` and `no_sync()`.
#
# Everything below runs on a laptop CPU: the processes talk over gloo on 127.0.0.1. On GPUs
# the same code uses NCCL.

# %%
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

ROOT = Path(os.environ.get("COURSE_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "labs" / "lab01_ddp.py").exists()))
sys.path.insert(0, str(ROOT / "lessons"))
sys.path.insert(0, str(ROOT / "labs"))

import ddp_workers  # noqa: E402  (worker functions live in a module: spawn re-imports them)
import lab01_ddp as lab  # noqa: E402  (the lab is importable: nothing runs at import)
from spawn import run_workers  # noqa: E402

# %% [markdown]
# ## Why
#
# One process can only use one device. `torch.nn.DataParallel` tried to drive several GPUs
# from a single Python process: it copies the model to every GPU on every step, gathers all
# outputs on GPU 0, and fights the GIL. GPU 0 becomes the bottleneck. **DistributedDataParallel
# (DDP)** runs one process per device instead. Each process (a *rank*) holds a full replica of
# the model, reads a different slice of every batch, and after `backward()` the ranks
# **all-reduce** their gradients, so every replica applies the identical update.
#
# How much is communicated? Every step, each rank sends and receives about
# 2(n-1)/n x the gradient bytes (a ring all-reduce). For the lab's tiny model:

# %%
cfg = lab.parse_config([])
model = lab.build_model(cfg)
num_params = sum(p.numel() for p in model.parameters())
grad_bytes = num_params * 4  # fp32 gradients
for world_size in (2, 4, 8):
    sent = 2 * (world_size - 1) / world_size * grad_bytes
    print(f"world size {world_size}: {num_params:,} params -> {sent / 1e6:.2f} MB per rank per step")
assert num_params == 139_584

# %% [markdown]
# The same arithmetic at scale: a 1B-parameter model in fp32 moves ~7.5 GB per rank per step at
# 16 ranks. DDP hides most of it behind the backward pass (below), but the memory cost is
# the real limit: every rank holds parameters, gradients and optimizer state in full (about
# 16 bytes per parameter with Adam in fp32), which is where FSDP (lesson 02) comes in.
#
# ## From scratch: average the gradients yourself
#
# Two processes, one model each (same initial weights), each does backward on its half of a
# 16-sequence batch. Then one collective, `all_reduce(SUM)`, and a division by the world size.
# The worker compares the result with DDP on the same halves, and with one process doing
# backward on the whole batch.

# %%
import inspect  # noqa: E402

print(inspect.getsource(ddp_workers.average_gradients_by_hand))

# %%
by_hand = run_workers(ddp_workers.average_gradients_by_hand, 2)
for rank, result in enumerate(by_hand):
    print(f"rank {rank}: |manual - DDP| = {result['manual_vs_ddp']:.1e}, "
          f"|manual - whole batch| = {result['manual_vs_whole_batch']:.1e}")
assert all(r["manual_vs_ddp"] == 0.0 for r in by_hand)  # DDP does exactly this sum
assert all(r["manual_vs_whole_batch"] < 1e-6 for r in by_hand)  # = full-batch gradient

# %% [markdown]
# Bit-for-bit equal to DDP, and equal to the whole-batch gradient up to float rounding
# (~1e-8): the mean of the two half-batch means *is* the mean over the batch, because the
# halves are the same size. That is the whole idea of data parallelism.
#
# ## With PyTorch: the five changes
#
# Going from a single-process script to DDP takes five changes. Here they are in the lab
# (the code printed is the code that runs):
#
# 1. **Start a process group**, after `set_device` on GPUs (or every rank lands on `cuda:0`),
#    with an explicit timeout so a stuck peer becomes an error instead of a hang.
# 2. **Wrap the model** in `DistributedDataParallel`.
# 3. **Give each rank different data**: `DistributedSampler`, and `set_epoch(epoch)` every
#    epoch, or every epoch repeats the same order.
# 4. **Accumulate without syncing**: `no_sync()` on all but the last micro-step.
# 5. **Log and checkpoint from rank 0 only**, saving `model.module` (the unwrapped model).

# %%
print(inspect.getsource(lab.init_distributed))
print(inspect.getsource(lab.apply_ddp))

# %%
print(inspect.getsource(lab.micro_batches))
print(inspect.getsource(lab.train_step))

# %% [markdown]
# ## Buckets and no_sync: counting the all-reduces
#
# DDP does not wait for the whole backward pass. It groups gradients into **buckets** of about
# `bucket_cap_mb`, in the order backward produces them, and launches one all-reduce per bucket as
# soon as the bucket is full, while backward continues on earlier layers. A bucket closes once it
# reaches the cap, and a parameter is never split, so every bucket but the last holds at least
# `bucket_cap_mb`, and at most the cap plus one parameter.
#
# One exception, when `bucket_cap_mb` is left at its default (`None`, meaning 25 MiB): the first
# bucket, the one whose all-reduce starts first in backward, is capped at
# `dist._DEFAULT_FIRST_BUCKET_BYTES` = 1 MiB, so communication starts early. Passing
# `bucket_cap_mb=25` explicitly gives every bucket 25 MiB. The lab passes `--bucket-cap-mb`
# (default 25) explicitly, so the counts below follow the plain rule.
#
# The worker registers a communication hook (the stock all-reduce, plus a counter) and trains
# with 4 micro-steps per optimizer step.

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
# The exception, measured: the lab model at width 256 (8.5 MB of fp32 gradients), one backward
# after DDP has rebuilt its buckets, with DDP's default cap and with `bucket_cap_mb=25` given.

# %%
caps = run_workers(ddp_workers.bucket_sizes_default_vs_explicit_cap, 2)[0]
for label, sizes in caps["sizes"].items():
    print(f"bucket_cap_mb {label:<11}: all-reduces of {', '.join(f'{b:,}' for b in sizes)} bytes")
first_cap = caps["first_bucket_cap"]
assert first_cap == 2**20
default, explicit = caps["sizes"]["default"], caps["sizes"]["explicit 25"]
assert len(default) == 2 and len(explicit) == 1 and sum(default) == sum(explicit)
# The first bucket closes as soon as it reaches 1 MiB: at most one parameter more than that.
largest_param_256 = 256 * 4 * 256 * 4  # w1 or w3 at width 256: 1 MiB of fp32
assert first_cap <= default[0] < first_cap + largest_param_256

# %% [markdown]
# Now the same 4 micro-steps with `no_sync()` on the first three: gradients accumulate locally
# and only the last backward launches its buckets.

# %%
no_sync = run_workers(ddp_workers.count_buckets, 2, 0.05, 4, True, 10)[0]
synced = bucket_runs[0.05]
print(f"without no_sync: {synced['allreduce_calls_per_step']:.0f} all-reduces/step, "
      f"{synced['ms_per_step']:.0f} ms/step")
print(f"with no_sync:    {no_sync['allreduce_calls_per_step']:.0f} all-reduces/step, "
      f"{no_sync['ms_per_step']:.0f} ms/step")
assert no_sync["allreduce_calls_per_step"] * 4 == synced["allreduce_calls_per_step"]

# %% [markdown]
# The counts are exact; the times are honest measurements on whatever machine ran this page
# (two CPU processes here, sharing the cores, so do not read much into small differences).
# On GPUs, communication runs on its own stream and really overlaps with backward; on this
# CPU-only gloo setup compute and communication compete for the same cores. The first step is
# left out of the counts: DDP uses it to learn the order in which gradients become ready, then
# rebuilds its buckets in that order.
#
# ## Run the lab
#
# `labs/lab01_ddp.py` is the complete, copyable version: the model, data, checkpoints, logging.
# Run it on two processes with `--check-parity`: after training, rank 0 retrains in a single
# process on the same global batches and compares every parameter.

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
# The last line says it: two processes trained the same model one process would have, to
# within float rounding. Here are both loss curves.

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
# A subtle point about that reference. It accumulates the gradients of each rank's
# micro-batches in one process, which is exactly the mean gradient of the global batch. A
# reference that instead runs the 16 sequences as one big batch computes the same mean with a
# different summation order. The difference is ~1e-8 per gradient entry, but Adam divides each
# update by the running root-mean-square of that entry's gradient, and for entries that cancel
# to nearly zero, rounding noise of 1e-8 becomes a relative error of order one. Try it
# (exercise 3): the parameters then differ by about 2e-5. That is not a DDP bug; it is Adam
# amplifying float rounding.
#
# With 4 processes and gradient accumulation (2 micro-steps per optimizer step, `no_sync` on
# the first) the result is the same:

# %%
ddp4 = run_lab(4, "--check-parity", "--grad-accum", "2")
print(f"4 ranks x 2 micro-steps: final loss {ddp4['final_loss']:.4f}, "
      f"parity {ddp4['parity_max_abs_diff']:.1e}")
assert ddp4["parity_max_abs_diff"] <= 1e-5
assert abs(ddp4["final_loss"] - ddp2["final_loss"]) < 1e-4

# %% [markdown]
# ## Summary
#
# - DDP = one process per device + a full replica each + an all-reduce of gradients.
# - The all-reduced gradient is the global-batch gradient, so N ranks train the same model as one
#   process with N times the batch: measured here to within 1e-5.
# - DDP buckets gradients (`bucket_cap_mb`) and launches each bucket's all-reduce as soon as it is
#   ready; `no_sync()` skips the all-reduce on accumulation micro-steps.
# - Memory does not shrink with more ranks: every rank holds everything. Lesson 02 (FSDP) fixes
#   that.
#
# ## Exercises
#
# 1. **`--bucket-cap-mb`**: predict the number of all-reduces per backward for a cap of 0.1 MB
#    with the rule above, then check it with `ddp_workers.count_buckets`.
#    Self-check: `assert per_backward <= math.ceil(558_336 / (0.1 * 2**20))`.
# 2. **`set_epoch`**: comment out `sampler.set_epoch(epoch)` in a copy of the lab and show that
#    epoch 2 sees the same order as epoch 1 (hint: print the first indices of `list(sampler)`).
# 3. **The reference**: change `train_reference` to use one big batch per step (grad_accum 1 on
#    the concatenated micro-batches) and measure the parity at 4 ranks; then switch the optimizer
#    to SGD and measure again. Explain the difference.
# 4. **Resume**: run with `--checkpoint-dir ckpt --stop-at-step 15`, then again without
#    `--stop-at-step`; compare the final checkpoint with an uninterrupted run (`torch.equal`).
#
# <details><summary>Worked answer to exercise 1</summary>
#
# 0.1 MB = 104,857.6 bytes; 558,336 / 104,857.6 = 5.3, so at most 6 buckets, and at least
# floor(558,336 / (104,857.6 + 65,536)) = 3: the measured count must land in 3..6, and
# `count_buckets` shows where.
# </details>
#
# ## If it breaks
#
# - Hangs at start-up or in a collective: [the runbooks](../runbooks/index.md).
# - Out of memory: every rank holds the full model; see the OOM runbook via
#   [the runbooks](../runbooks/index.md), and lesson 02.
# - One rank slow, the others timing out: usually data loading; the lab's log line shows the
#   data-wait share per step (`data N%`).
