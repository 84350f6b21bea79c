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
# - turn a single-process training script into a DDP one: five changes, read as a diff;
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
import torch

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
# ## With PyTorch: the diff
#
# `lessons/train_plain.py` is a plain single-process training loop of about 40 lines.
# `lessons/train_ddp.py` is the same script with DDP. The whole difference:

# %%
import difflib  # noqa: E402

plain, ddp = (ROOT / "lessons" / name for name in ("train_plain.py", "train_ddp.py"))
diff = list(difflib.unified_diff(plain.read_text().splitlines(), ddp.read_text().splitlines(),
                                 "train_plain.py", "train_ddp.py", lineterm="", n=1))
print("\n".join(diff))
changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
assert len(plain.read_text().splitlines()) < 50 and len(changed) < 35  # docstrings included

# %% [markdown]
# Read it as five changes (the docstrings aside):
#
# 1. **Start a process group** with an explicit timeout, so a stuck peer becomes an error
#    instead of a hang (on GPUs: `nccl`, after `torch.cuda.set_device(local_rank)`).
# 2. **Wrap the model** in `DistributedDataParallel`: it broadcasts rank 0's weights, then
#    all-reduces the gradients during `backward()`.
# 3. **Give each rank different data**: a `DistributedSampler` and a per-rank batch of
#    `BATCH // world_size`, with `set_epoch(epoch)` every epoch (without it every epoch repeats
#    the first order: [runbook](../runbooks/dataloader-same-order-every-epoch.md)).
# 4. **Print and save on rank 0 only**, saving `model.module` so the keys have no `module.`
#    prefix.
# 5. **Destroy the group at the end** (`dist.destroy_process_group()`), once training is
#    done, so every rank leaves the job cleanly.
#
# <details><summary>Why the script starts and destroys the group outside main()</summary>
#
# The DDP model holds the process group. If the model is still alive when the group is
# destroyed, a gloo rank can abort at exit with
# `terminate called without an active exception`. So the model lives inside `main()`, and `gc.collect()` runs after it returns and
# before the group goes (reference cycles can keep the model alive; without the collect, 2 of
# 12 runs here still aborted). The [exit-hang runbook, cause D](../runbooks/exit-hang.md) has
# the drill.
# </details>
#
# Both scripts, run for real: one process on the whole batch, two DDP ranks on half each.

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
# The same model, to rounding: the mean of two half-batch gradients is the whole batch's. The
# order matches too, because `DistributedSampler(seed=0)` and the plain script's
# `RandomSampler` draw the same `randperm` for each epoch, and DDP's rank r takes every
# `world_size`-th index of it.
#
# The lab does the same with what a long job adds: gradient accumulation with `no_sync()` on
# all but the last micro-step (its `gradient_sync`, which the kit's `train_step` enters around
# each micro-step), checkpoints, logging and fault handling. (Its `init_distributed()` also
# builds a restart-safe store; why is in [restart hang](../runbooks/restart-hang.md).)

# %%
print(inspect.getsource(lab.apply_ddp))
print(inspect.getsource(lab.gradient_sync))
print(inspect.getsource(lab.train_step))  # from the kit: labs/labkit/loop.py

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
# `labs/lab01_ddp.py` is the copyable version: DDP written out in the order it happens (the process
# group, the sampler, the wrap, `no_sync`, rank-0 checkpoints), on the lab kit beside it
# (`labs/labkit/`: model, data, the loop and its log, metrics, the parity reference).
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
# micro-batches in one process, which is exactly the mean gradient of the global batch; one
# big batch of 16 would sum the same mean in another order, about 1e-8 apart. At AdamW's first
# step such rounding can move a weight by a full step, which is why the labs warm the learning
# rate up: without warmup, 3 ranks miss 1e-5 (1.4e-5, `tests/test_odd_world_sizes.py`).
# [Lesson 03 measures why](03_tp_fsdp.ipynb#why-fp32-parity-needs-warmup-adamws-first-step).
#
# With 4 processes and gradient accumulation (2 micro-steps per optimizer step, `no_sync` on
# the first) the result is the same. The lab's default global batch is 8 sequences per rank
# and micro-step, so it grows with the world size; `--batch-size 16` keeps the 2-rank run's:

# %%
ddp4 = run_lab(4, "--check-parity", "--grad-accum", "2", "--batch-size", "16")
print(f"4 ranks x 2 micro-steps: final loss {ddp4['final_loss']:.4f}, "
      f"parity {ddp4['parity_max_abs_diff']:.1e}")
assert ddp4["parity_max_abs_diff"] <= 1e-5
assert abs(ddp4["final_loss"] - ddp2["final_loss"]) < 1e-4

# %% [markdown]
# ## What DDP users run into
#
# Five things that the loop above never meets and real models do, each run here on two gloo
# processes (`lessons/ddp_workers.py`) unless marked.
#
# ### A parameter that gets no gradient
#
# DDP waits, in every backward, for a gradient of every parameter. A branch that forward never
# uses (a frozen head, an `if` on the input) never delivers one, and the *next* forward fails.
# `find_unused_parameters=True` makes DDP walk the autograd graph after each forward and mark
# such parameters ready (a CPU cost per step, so only where needed):

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
# ### BatchNorm statistics drift apart
#
# Buffers are not gradients: DDP never all-reduces them. By default it copies rank 0's buffers
# to every rank at the start of each forward (`forward_sync_buffers=True`, called
# `broadcast_buffers` before torch 2.13, which now warns about the old name). So the ranks
# agree when each forward starts, each then updates its running statistics with its own data,
# and a checkpoint from rank 0 holds statistics of rank 0's data only. Switched off, the ranks
# drift further apart with every step. Here the two ranks see data with different means:

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
# The statistic that *should* normalise a global batch is its mean over every rank's samples.
# By hand that is one all-reduce of each rank's batch mean (and the same for the variance),
# which equals one process on the whole batch to rounding (asserted above). That is what
# `torch.nn.SyncBatchNorm` does inside forward; convert a model with
# `nn.SyncBatchNorm.convert_sync_batchnorm(model)` before wrapping it in DDP. It runs on GPUs
# only: on CPU its forward raises `SyncBatchNorm expected input tensor to be on GPU or XPU or
# privateuseone`, so the next cell runs only where there is a GPU.

# %%
if torch.cuda.is_available():  # GPU only, not executed in CI (this machine has no GPU)
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
# ### Uneven inputs and Join
#
# If ranks run different numbers of batches (an `IterableDataset` split by files, a custom
# sampler), the rank with more batches waits in an all-reduce that the others never start. Here
# rank 0 has 3 batches and rank 1 has 5. Without `Join`, rank 1 fails at its 4th batch as soon
# as rank 0 exits (or after the timeout, if rank 0 is still alive). Inside
# `with Join([model]):`, a rank that ran out of data keeps answering the others' all-reduces
# with zeros until everyone is done:

# %%
without = run_workers(ddp_workers.uneven_inputs, 2, False, timeout_s=10)
joined = run_workers(ddp_workers.uneven_inputs, 2, True)
for name, ranks in (("without Join", without), ("with Join", joined)):
    print(f"{name:12s}: steps per rank {[r['steps'] for r in ranks]}, "
          f"errors {[r['error'][:60] + '...' if r['error'] else None for r in ranks]}")
assert without[1]["steps"] == 3 and without[1]["error"] is not None
assert [r["steps"] for r in joined] == [3, 5] and not any(r["error"] for r in joined)

# %% [markdown]
# (With the default `DistributedSampler` this cannot happen: it pads so that every rank gets
# the same number of batches.)
#
# ### Compressing the gradients: a communication hook
#
# `model.register_comm_hook(state, hook)` replaces what DDP does with each bucket. The stock
# hooks in `torch.distributed.algorithms.ddp_comm_hooks.default_hooks` include
# `fp16_compress_hook` and `bf16_compress_hook`: all-reduce a 16-bit copy of the bucket, then
# cast the sum back. Half the bytes on the wire, paid for with 16-bit rounding of the gradient
# sum. `bf16_compress_hook` refuses gloo (`BF16 all reduce communication hook required CUDA
# 11+ and NCCL 2.10+`, GPU only), so on CPU the fp16 hook shows the same mechanism:

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
# ### DataParallel is not a shortcut
#
# `torch.nn.DataParallel(model)` drives every GPU from one Python process. Each step it copies
# the parameters from GPU 0 to the others, scatters the batch, runs the replicas in threads
# (which share the GIL), and gathers the outputs back on GPU 0, which also computes the loss.
# GPU 0 holds more than the others and becomes the bottleneck; the PyTorch docs recommend DDP
# even on one machine. DDP's one process per GPU has none of this. The cell below measures one
# step of each kind where two GPUs exist (GPU only, not executed in CI: no numbers on this
# page until someone runs it on GPUs):

# %%
if torch.cuda.device_count() >= 2:  # GPU only, not executed in CI
    import time as _time

    gpu_model = lab.build_model(cfg).cuda()
    dp_model = torch.nn.DataParallel(gpu_model)
    tokens = torch.randint(0, cfg.vocab_size, (64, cfg.seq_len), device="cuda")
    for label, net in (("one GPU", gpu_model), ("DataParallel", dp_model)):
        for attempt in range(3):  # the first call warms up
            torch.cuda.synchronize()
            t0 = _time.perf_counter()
            net(tokens).float().mean().backward()
            torch.cuda.synchronize()
        print(f"{label}: {(_time.perf_counter() - t0) * 1e3:.1f} ms per step")
else:
    print("GPU only: needs 2 CUDA GPUs; not executed here")

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
# - **Graded:** DDP by hand (broadcast, gradient hooks, buckets overlapped with backward). Fill in `exercises/ddp.py`, then run
#   `python exercises/grade.py ddp`: it checks your code against one process, check by check
#   ([the exercises](../exercises/README.md)).
#
# Each exercise below is checked: it has a self-check (a Python block your answer must pass)
# and a worked answer, collapsed, in [the exercise book](../docs/onboarding-exercises.md).
#
# 1. **Predict DDP's buckets**: the bucket sizes DDP all-reduces for a `--bucket-cap-mb`,
#    checked against DDP's own
#    ([onboarding exercise 1.1](../docs/onboarding-exercises.md#exercise-11-predict-ddps-buckets)).
# 2. **Which samples each rank reads**: what `DistributedSampler` gives each rank after
#    `set_epoch`, and whether a rank runs out first
#    ([onboarding exercise 1.2](../docs/onboarding-exercises.md#exercise-12-which-samples-each-rank-reads)).
# 3. **Resume mid-epoch**: the first micro-batch a rank reads when lab01 resumes from a
#    checkpoint
#    ([onboarding exercise 1.3](../docs/onboarding-exercises.md#exercise-13-resume-mid-epoch)).
#
# ## If it breaks
#
# - Hangs at start-up or in a collective: [the runbooks](../runbooks/index.md).
# - Out of memory: every rank holds the full model; see the OOM runbook via
#   [the runbooks](../runbooks/index.md), and lesson 02.
# - One rank slow, the others timing out: usually data loading; the lab's log line shows the
#   data-wait share per step (`data N%`).
