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
# # 00 · Processes, ranks and collectives
#
# Every later lesson (DDP, FSDP, tensor and pipeline parallel) is a way of arranging a few
# communication calls. This lesson makes them, by hand, before any wrapper hides them.
#
# After it you will be able to:
# - say what `torchrun` starts: processes, the `RANK` / `LOCAL_RANK` / `WORLD_SIZE` /
#   `MASTER_ADDR` / `MASTER_PORT` variables, the rendezvous store, and the backend;
# - predict what every rank holds after `broadcast`, `all_reduce` (SUM and AVG), `reduce`,
#   `all_gather`, `reduce_scatter`, `all_to_all`, `send` / `recv` and `barrier`;
# - write a ring all-reduce from `send` / `recv` and explain why it moves 2(n-1)/n of the
#   message per rank;
# - measure latency and bandwidth of `all_reduce`, and read algorithm vs bus bandwidth the way
#   nccl-tests reports them;
# - name the collectives that DDP, FSDP, TP and PP issue.

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
# ## Why
#
# Data-parallel training keeps one copy of the model per process, and after every backward
# pass each copy needs the sum of everyone's gradients. Take a 1-billion-parameter model with
# fp32 gradients on 8 processes: 4 GB per process. The obvious way, "everyone sends to rank 0,
# rank 0 adds and sends the result back", makes rank 0 receive 7 copies and send 7 copies
# while the other ranks idle. A ring all-reduce (built by hand below) makes every rank send
# the same, much smaller amount, which hardly depends on the number of ranks. The cell
# computes both.

# %%
num_params, bytes_per_grad, n = 1_000_000_000, 4, 8
grad_bytes = num_params * bytes_per_grad
naive_rank0 = (n - 1) * grad_bytes              # rank 0 receives this much, then sends as much
ring_per_rank = 2 * (n - 1) / n * grad_bytes    # every rank sends this much, and receives as much
print(f"gradients: {grad_bytes / 1e9:.0f} GB | through rank 0: rank 0 receives "
      f"{naive_rank0 / 1e9:.0f} GB and sends {naive_rank0 / 1e9:.0f} GB | "
      f"ring: every rank sends {ring_per_rank / 1e9:.0f} GB and receives as much")
assert grad_bytes == 4e9 and naive_rank0 == 28e9 and ring_per_rank == 7e9
# The busiest rank moves n/2 times fewer bytes with the ring, and the gap grows with n.
assert naive_rank0 / ring_per_rank == n / 2

# %% [markdown]
# ## From scratch
#
# ### Processes and ranks
#
# Distributed PyTorch is several ordinary Python processes, usually one per GPU. Nothing is
# shared between them (each has its own memory, its own model, its own Python objects); they
# only cooperate by calling the same communication functions in the same order.
#
# `torchrun --nproc-per-node N script.py` starts N copies of `script.py` on this node and sets
# environment variables in each:
#
# | variable | meaning |
# |---|---|
# | `RANK` | this process's id in the whole job, `0 .. WORLD_SIZE-1` |
# | `LOCAL_RANK` | its id on this node: which GPU it should use |
# | `WORLD_SIZE` | how many processes in total, on all nodes |
# | `LOCAL_WORLD_SIZE` | how many on this node |
# | `MASTER_ADDR`, `MASTER_PORT` | where the rendezvous store listens |
#
# `dist.init_process_group()` (the `env://` method, the default) reads these. A small
# key-value server, a `TCPStore`, listens at `MASTER_ADDR:MASTER_PORT` (rank 0 hosts it, or,
# under torchrun, the torchrun process of the first node); every rank connects to it, and the
# ranks swap their network addresses through it. Only then does the backend (gloo or NCCL)
# open direct connections between ranks. That is why one address is enough to start a job
# on many machines, and why a wrong `MASTER_ADDR` makes every rank wait at start-up.
#
# In a notebook we cannot run `torchrun` on a cell, so `lessons/spawn.py` does the same job:
# it starts N processes, sets those variables, calls `init_process_group("gloo")` and returns
# what each rank's function returned. Here each rank reports what it sees, and also connects
# to the rendezvous store itself, writes its process id under a key, and waits for all the
# others' keys.

# %%
views = run_workers(cw.describe_process, 4, timeout_s=60)
for v in views:
    print(f"rank {v['rank']} of {v['world_size']} | pid {v['pid']} | backend {v['backend']} | "
          f"env {v['env']} | pids read from the store {v['pids_seen']}")
pids = [v["pid"] for v in views]
assert len(set(pids)) == 4                                   # four separate processes
assert [int(v["env"]["RANK"]) for v in views] == [v["rank"] for v in views] == [0, 1, 2, 3]
assert all(v["world_size"] == 4 and v["env"]["WORLD_SIZE"] == "4" for v in views)
assert all(v["pids_seen"] == pids for v in views)            # everyone met in the store
assert len({v["env"]["MASTER_PORT"] for v in views}) == 1    # one address for all ranks

# %% [markdown]
# ### Backends: NCCL for CUDA tensors, gloo for CPU tensors
#
# A backend does the actual communication. NCCL runs collectives on CUDA tensors with GPU
# kernels over NVLink, PCIe or InfiniBand; gloo runs them on CPU tensors over TCP. The API is
# the same, which is why every lab in this course is one file for both. The labs pick with
# one rule: CUDA + NCCL when every local rank has its own GPU, else CPU + gloo. This is the
# code that does it, `pick_device_type` from the labs' kit (`labs/labkit/runtime.py`) and
# `init_distributed` from `labs/lab01_ddp.py` (printed from the files, so it is the code that runs):

# %%
sys.path.insert(0, str(ROOT / "labs"))
import lab01_ddp as lab01  # noqa: E402  defines functions only: nothing runs at import
print(inspect.getsource(lab01.pick_device_type))  # from its kit, labs/labkit/runtime.py
print(inspect.getsource(lab01.init_distributed))
assert '"nccl"' in inspect.getsource(lab01.init_distributed)
assert '"gloo"' in inspect.getsource(lab01.init_distributed)

# %% [markdown]
# Two details in it matter on GPUs. `torch.cuda.set_device(local_rank)` comes before
# `init_process_group`, otherwise every rank's NCCL communicator lands on `cuda:0`. And the
# `timeout` is explicit: a collective that some rank never joins raises after that long
# instead of hanging forever.
#
# ### A ring all-reduce from send and recv
#
# `send(tensor, dst)` and `recv(tensor, src)` move one tensor between two ranks; the receiver
# must allocate a tensor of the right shape and dtype first. Everything else can be built
# from them. The ring all-reduce puts the n ranks on a ring, cuts the tensor into n chunks,
# and runs two phases:
#
# 1. **reduce-scatter**, n-1 steps: at step s, rank r sends chunk (r - s) to its right
#    neighbour and adds the chunk (r - s - 1) that arrives from its left. After n-1 steps
#    rank r holds the complete sum of chunk (r + 1).
# 2. **all-gather**, n-1 steps: the finished chunks travel once more around the ring, each
#    receiver overwriting its stale copy.
#
# Here is the code, from `lessons/collective_workers.py`:

# %%
print(inspect.getsource(cw.exchange))
print(inspect.getsource(cw.ring_all_reduce))

# %% [markdown]
# Every rank sends and receives at the same time, so `exchange` sends with the non-blocking
# `isend`: if all ranks called a blocking `send` first, each could wait for a neighbour that
# is itself stuck in `send`, and the ring could deadlock.
#
# To see the phases, rank r starts with 10^r in every element, so the digits of a sum name the
# ranks in it (1101 = ranks 0, 2 and 3). The darker the box, the more ranks have been added.
# `check_ring` also runs the ring on 1000 random floats and on 1000 random integers and
# compares with the library's `dist.all_reduce`.

# %%
ring = run_workers(cw.check_ring, 4, timeout_s=60)
trace = [[ring[r]["trace"][step] for r in range(4)] for step in range(len(ring[0]["trace"]))]
labels = ["start"] + [f"reduce-scatter {s + 1}" for s in range(3)] + [
    f"all-gather {s + 1}" for s in range(3)]
cw.draw_ranks("ring all-reduce, 4 ranks: what each rank holds after each step",
              [(label, rows, "digits") for label, rows in zip(labels, trace)])
plt.show()

assert len(trace) == 1 + 2 * 3                               # 2(n-1) steps
after_reduce_scatter = trace[3]
for r in range(4):  # rank r owns the complete chunk (r + 1) % n after phase 1 ...
    assert after_reduce_scatter[r][(r + 1) % 4] == 1111
assert all(torch.equal(row, torch.full((4,), 1111.0, dtype=torch.float64)) for row in trace[-1])
for r, result in enumerate(ring):  # ... and the full result agrees with the library's
    print(f"rank {r}: max |ring - dist.all_reduce| = {result['max_abs_diff']:.1e} (floats); "
          f"integers identical: {result['ints_equal']}; sent {result['bytes_sent']} B "
          f"of a {result['bytes_total']} B tensor")
    assert result["ints_equal"] and result["max_abs_diff"] <= 1e-5
    assert result["bytes_sent"] == 2 * (4 - 1) / 4 * result["bytes_total"]

# %% [markdown]
# On integers the two results are identical. On floats they may differ in the last bits:
# the ring adds in a different order than the library's algorithm, and floating-point addition
# is not associative. And each rank sent exactly 2(n-1)/n of the tensor's bytes: n-1 chunks
# of S/n in each phase.
#
# ### The cost model
#
# Give each step a fixed cost alpha (the latency of starting a message) and let every rank
# send at B bytes/s. A ring all-reduce of S bytes on n ranks then takes
#
#     t(S) = 2(n-1) * alpha  +  2(n-1)/n * S / B
#
# Small messages pay mostly the latency term, large ones the bandwidth term. The bandwidth
# term barely grows with n (2(n-1)/n stays below 2), which is why ring all-reduce scales;
# the latency term grows linearly with n, which is why NCCL also implements tree-shaped
# algorithms (latency growing like log n) and picks an algorithm per call.
#
# Two bandwidths come out of a measurement, as
# [nccl-tests](https://github.com/NVIDIA/nccl-tests/blob/03a204a1f38aaea17f1a777885bb2d9600ba7eff/doc/PERFORMANCE.md)
# defines them:
# - **algorithm bandwidth** `algbw = S / t`: what the caller sees. For all-reduce it falls
#   as n grows, even on perfect hardware, because each rank must move 2(n-1)/n * S.
# - **bus bandwidth** `busbw = algbw x factor`, with factor 2(n-1)/n for all-reduce, (n-1)/n
#   for all-gather, reduce-scatter and all-to-all (S = the full, gathered size), and 1 for
#   broadcast and reduce. It undoes that n-dependence, so it can be compared with the link's
#   peak, whatever n was.

# %%
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
                "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}
# The all-reduce factor is exactly what the ring above sent, per byte of tensor:
assert BUSBW_FACTOR["all_reduce"](4) == ring[0]["bytes_sent"] / ring[0]["bytes_total"]
for n in (2, 4, 8, 64):
    print(f"n={n:3d}: all-reduce busbw = algbw x {BUSBW_FACTOR['all_reduce'](n):.3f}")

# %% [markdown]
# ## With PyTorch
#
# ### Every collective, on 4 processes
#
# `run_collectives` runs each call once on 4 gloo processes. Rank r starts with the values
# 10r, 10r+1, ...: the tens digit, and the colour, say which rank a value came from. Grey
# boxes are sums of several ranks; a hatched row is undefined after the call. Every
# collective must be called by **every** rank of the group, in the same order, with matching
# shapes: that is the contract, and breaking it is the most common distributed hang.

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
# **broadcast**: one rank (`src`) sends its tensor to all. Used to make every replica start
# from rank 0's weights (DDP does this when it wraps a model) and to share a config or seed.

# %%
before, after = show("broadcast", "dist.broadcast(x, src=0)")
assert all(torch.equal(a, initial[0]) for a in after)

# %% [markdown]
# **all_reduce**: every rank ends with the elementwise reduction of all ranks' tensors,
# in place. `ReduceOp.SUM` adds; `ReduceOp.AVG` divides by n as well, which is exactly the
# data-parallel gradient average.

# %%
total = sum(initial)
before, after = show("all_reduce_sum", "dist.all_reduce(x, op=SUM)", reduced=True)
assert all(torch.equal(a, total) for a in after)
before, after = show("all_reduce_avg", "dist.all_reduce(x, op=AVG)", reduced=True)
assert all(torch.allclose(a, total / WORLD_SIZE) for a in after)

# %% [markdown]
# **reduce**: the same reduction, but only `dst` is promised the result; do not read the
# tensor on the other ranks afterwards (hatched). Use it when only one rank needs the answer,
# e.g. a loss to log.

# %%
before, after = show("reduce", "dist.reduce(x, dst=0, op=SUM)", reduced=True)
assert torch.equal(after[0], total) and after[1:] == [None] * (WORLD_SIZE - 1)

# %% [markdown]
# **all_gather**: every rank contributes a tensor and every rank gets all of them, in rank
# order. FSDP all-gathers a layer's parameter shards right before computing with it.

# %%
before, after = show("all_gather", "dist.all_gather(list_of_n, x)")
assert all(torch.equal(a, torch.cat(initial)) for a in after)

# %% [markdown]
# **reduce_scatter**: each rank passes n chunks; rank i receives the reduction of everyone's
# chunk i. It is the first half of the ring all-reduce on its own, and FSDP's gradient step:
# each rank ends with the summed gradient of only the shard it owns.

# %%
before, after = show("reduce_scatter", "dist.reduce_scatter(out, list_of_n)", reduced=True)
column_sums = torch.stack([cw.rank_values(r, WORLD_SIZE) for r in range(WORLD_SIZE)]).sum(0)
assert all(torch.equal(after[i], column_sums[i:i + 1]) for i in range(WORLD_SIZE))

# %% [markdown]
# **all_to_all**: rank i sends its j-th piece to rank j, a transpose across ranks. Mixture
# of experts uses it to send each token to the rank holding its expert. The demo calls the
# single-tensor form `all_to_all_single`, the one such code uses.

# %%
before, after = show("all_to_all", "dist.all_to_all_single(out, x)")
assert all(torch.equal(after[i], torch.stack(before)[:, i]) for i in range(WORLD_SIZE))

# %% [markdown]
# **send / recv**: point to point. Here each rank passes its tensor to the right neighbour
# (the ring's building block); a pipeline passes activations from one stage to the next.

# %%
before, after = show("send_recv", "isend to rank+1, recv from rank-1")
assert all(torch.equal(after[r], initial[(r - 1) % WORLD_SIZE]) for r in range(WORLD_SIZE))

# %% [markdown]
# **barrier**: no data, only a meeting point: nobody leaves until everyone has arrived. Here
# rank r slept 0.3 x r seconds before calling it. Use barriers sparingly (e.g. before rank 0
# reads files the others wrote); a collective already synchronises the ranks that take part.

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
assert min(left) >= max(arrived)        # nobody left before the last rank arrived

# %% [markdown]
# ### Groups of ranks, and calls that return at once
#
# Every call above ran on the **default process group**, all 4 ranks, the one
# `init_process_group` creates. A process group is just a set of ranks that talk together;
# `dist.new_group(ranks)` makes another, and every collective takes `group=` to run on it
# alone. Every rank must create every group, in the same order, even the ones it is not in.
# Later lessons run one kind of traffic per group: FSDP's all-gathers inside one set of ranks,
# tensor parallelism's inside another.
#
# Second, `async_op=True`: the call returns at once with a `Work` handle, the collective runs
# in the background, and `work.wait()` blocks until the result is in the tensor. In between,
# the rank can compute. This is how DDP overlaps its all-reduces with backward (lesson 01)
# and FSDP its all-gathers with the previous block's compute (lessons 02 and 06).

# %%
groups = run_workers(cw.groups_and_async, WORLD_SIZE, timeout_s=60)
for r, g in enumerate(groups):
    a = g["async"]
    print(f"rank {r}: group {g['group_ranks']} sums to {g['group_sum']:.0f} | all_reduce of 4 MiB "
          f"returned after {a['issued_s'] * 1e3:.2f} ms, done after {a['done_s'] * 1e3:.1f} ms")
assert [g["group_ranks"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
assert [g["group_sum"] for g in groups] == [1, 1, 5, 5]     # 0 + 1 and 2 + 3: each pair alone
assert all(g["async"]["sum_ok"] for g in groups)            # after wait(), the result is there

# %% [markdown]
# The times are this machine's, printed and not asserted: on a busy laptop a rank can be slow
# even to issue the call. What is guaranteed is the order: read the tensor only after
# `wait()`.

# %% [markdown]
# ### List forms and flat-buffer forms
#
# `all_gather` and `reduce_scatter` above take Python lists of n tensors. Both also have a
# flat-buffer form that reads or writes one contiguous tensor of n times the size, which
# saves copies and is what FSDP uses. In torch 2.13 they are `dist.all_gather_single` and
# `dist.reduce_scatter_single` (the older names warn; see the box).
#
# <details><summary>Versions: what differs in older torch (read once, then skip)</summary>
#
# This course is tested on torch 2.13. What the helpers in `collective_workers.py` do about
# older releases, from the pull requests' merge dates (not from runs on those versions):
#
# - The flat forms were called `all_gather_into_tensor` and `reduce_scatter_tensor` before
#   2.13. In 2.13 the old names still work but raise a `FutureWarning` (asserted below), and
#   the new names do not exist earlier, so the helpers pick whichever name exists:
#   `getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor`.
# - Gloo gained `ReduceOp.AVG` (pytorch PR #149781) and the list form of `reduce_scatter`
#   (PR #149869) in March 2025, so from torch 2.8 by date. `cw.all_reduce_avg` falls back to
#   SUM and a division, `cw.reduce_scatter_list` to the flat form. (That is the call; what it
#   sends is counted below.)
# - The list form `dist.all_to_all` is marked unsupported on gloo in the docs' backend table,
#   and the release where gloo gained it is not pinned down, so the course uses
#   `all_to_all_single` on CPU.
#
# The list forms of all-gather and reduce-scatter never changed, which is why the lesson
# teaches them first.
# </details>

# %%
print("flat all-gather used here:", cw.all_gather_single.__name__,
      "| flat reduce-scatter used here:", cw.reduce_scatter_single.__name__)
flat_after = [results[r]["all_gather_flat"][1] for r in range(WORLD_SIZE)]
assert all(torch.equal(a, torch.cat(initial)) for a in flat_after)       # same as the list form
flat_rs = [results[r]["reduce_scatter_flat"][1] for r in range(WORLD_SIZE)]
assert all(torch.equal(flat_rs[i], column_sums[i:i + 1]) for i in range(WORLD_SIZE))
warned = results[0]["old_name_warnings"]
print("calling dist.all_gather_into_tensor on this torch warned:", warned or "nothing")
if hasattr(torch.distributed, "all_gather_single"):   # torch >= 2.13
    assert any(w.startswith("FutureWarning") and "all_gather_single" in w for w in warned)

# %% [markdown]
# ### What gloo actually sends
#
# The cost model says what a ring must send. Linux counts every byte a process writes,
# sockets included (`/proc/self/io`), so the difference around one call is what that rank
# sent. `bytes_sent_per_collective` makes one call of each on 4 ranks (S = 4 MiB) and
# divides by S:

# %%
sent = run_workers(cw.bytes_sent_per_collective, WORLD_SIZE, timeout_s=60)
n = WORLD_SIZE
if sent[0]["all_reduce"] is None:
    print("not counted: this system has no /proc/self/io (it is Linux's)")
else:
    for name in ("all_reduce", "all_gather", "reduce_scatter"):
        print(f"{name:15s} each rank sent {sent[0][name]:.3f} S | a ring sends "
              f"{BUSBW_FACTOR[name](n):.3f} S")
    for per_rank in sent:  # within 1%: the rest is gloo's message headers
        assert abs(per_rank["all_reduce"] / BUSBW_FACTOR["all_reduce"](n) - 1) < 0.01
        assert abs(per_rank["all_gather"] / BUSBW_FACTOR["all_gather"](n) - 1) < 0.01
        # gloo's reduce-scatter sends what its all-reduce sends: twice a ring reduce-scatter
        assert abs(per_rank["reduce_scatter"] / per_rank["all_reduce"] - 1) < 0.01
        assert per_rank["reduce_scatter"] > 1.9 * BUSBW_FACTOR["reduce_scatter"](n)

# %% [markdown]
# All-reduce and all-gather send exactly what the ring sends. Reduce-scatter does not: gloo
# accepts it in both forms, but underneath it all-reduces the whole tensor and keeps its own
# chunk, so on gloo **a reduce-scatter costs an all-reduce**, twice a ring reduce-scatter's
# bytes. Lesson 06 counts on this when it predicts FSDP's step on CPU. NCCL runs a real ring
# reduce-scatter, (n-1)/n S per rank (*GPU only, not executed in CI*).

# %% [markdown]
# ### What the strategies of the next lessons do with these
#
# | strategy | what each rank holds | collectives per training step |
# |---|---|---|
# | DDP (lesson 01) | the full model, a slice of the batch | all-reduce (AVG) of gradients |
# | FSDP (lesson 02) | 1/n of each parameter | all-gather parameters before use, reduce-scatter gradients |
# | TP (lesson 03) | a slice of each weight matrix | all-reduce (row parallel) or all-gather / reduce-scatter (column and sequence parallel) inside a layer |
# | PP (lesson 04) | a few whole layers | send / recv of activations forward and of gradients backward |
#
# `strategy_patterns` does each one by hand on a tiny two-layer MLP (float64) and compares
# with the same computation in one process: DDP's averaged gradient, FSDP's gradient shard
# (all-gather the weight shards, backward, reduce-scatter the gradient), the tensor-parallel
# MLP output (column-parallel first layer, row-parallel second layer, one all-reduce), and a
# 4-stage pipeline's output.

# %%
print(inspect.getsource(cw.fsdp_pattern))
diffs = run_workers(cw.strategy_patterns, 4, timeout_s=60)[0]
for name, diff in diffs.items():
    print(f"{name:5s} max |distributed - single process| = {diff:.1e}")
assert set(diffs) == {"DDP", "FSDP", "TP", "PP"} and max(diffs.values()) <= 1e-12

# %% [markdown]
# ## Run the lab: torchrun, then a measurement
#
# ### What torchrun really starts
#
# This lesson has no separate lab: `lessons/collective_workers.py` is also a torchrun script
# (stdlib and torch only, like the labs). Each rank chooses its backend
# with the labs' rule, gathers every rank's environment with `all_gather_object` (a
# collective on pickled Python objects), all-reduces its rank number, and rank 0 writes the
# result as JSON. This is the exact command:

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
for key in ["MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"]:   # one rendezvous, shared
    assert envs[0][key] and envs[0][key] == envs[1][key], key
shared_store = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"
assert all(e["TORCHELASTIC_USE_AGENT_STORE"] == str(shared_store) for e in envs)
assert report["sum_of_ranks"] == 0 + 1
expected_backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"   # the labs' rule
assert all(view["backend"] == expected_backend for view in report["ranks"])

# %% [markdown]
# `--standalone` picked a free port on this machine and ran the rendezvous itself;
# `TORCHELASTIC_RUN_ID` names that rendezvous (on several nodes, `--rdzv-id` must be the same
# everywhere). `TORCHELASTIC_USE_AGENT_STORE=True` says the store the ranks met in is hosted
# by torchrun's own process (its "agent"), not by rank 0. The extra `GROUP_RANK` and `ROLE_*`
# variables come from that agent too; scripts rarely need them.
#
# ### Time vs message size on this machine
#
# Now the cost model against a real measurement: `dist.all_reduce` on 2 gloo processes,
# float32 tensors from 1 KiB to 16 MiB. Each point is the fastest of 25 short timed windows,
# each window the slowest rank's average over enough calls to last about 2 ms, with the sizes
# interleaved. Why the fastest: this machine is shared, and a slow window measures the other
# programs, not the collective.
#
# The fit is least squares on the alpha-beta model t(S) = a + b * S, weighted by 1/t so that the
# 1 KiB points count as much as the 16 MiB ones (unweighted, the largest times would decide
# everything and the latency would come out as noise). With the ring's formula,
# a = 2(n-1) * alpha and b = 2(n-1) / (n * B), so the bus bandwidth is 2(n-1)/n / b.

# %%
n = 2
sizes = [2 ** k for k in range(10, 25)]
timing = run_workers(cw.time_all_reduce, n, sizes, timeout_s=120)[0]
S = np.array([s for s, _ in timing], dtype=float)
t = np.array([seconds for _, seconds in timing])
A = np.stack([1 / t, S / t], axis=1)            # rows of (a + b*S) / t = 1
(a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
print(f"latency term a = {a * 1e6:.1f} us, bandwidth term b = 1 / ({1 / b / 1e9:.2f} GB/s)")
assert a > 0 and b > 0, (a, b)
model = a + b * S
r2 = 1 - np.sum(np.log(t / model) ** 2) / np.sum((np.log(t) - np.log(t).mean()) ** 2)
busbw_fit = BUSBW_FACTOR["all_reduce"](n) / b    # bytes/s
algbw = S / t
busbw = algbw * BUSBW_FACTOR["all_reduce"](n)
print(f"R^2 (log time) = {r2:.3f}; bus bandwidth from the fit = {busbw_fit / 1e9:.2f} GB/s; "
      f"the two terms are equal at S = a/b = {a / b / 1024:.0f} KiB")
assert r2 > 0.7, r2    # a + b * S explains most of the variation of log(time)

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
# Small messages are latency-bound: far below the fitted bandwidth. Large ones approach it.
assert busbw[0] < 0.5 * busbw_fit and busbw[-1] > busbw[0]

# %% [markdown]
# Read the left plot from left to right: flat where the latency term dominates, then a slope
# of 1 where time grows with size. The right plot is the same data as bandwidth: tiny
# messages use a small fraction of what the machine can move, which is why DDP packs
# gradients into buckets of megabytes instead of sending each parameter's gradient alone.
#
# What the fit predicts is only as good as its two numbers. With the same per-rank bandwidth,
# the algorithm bandwidth a caller sees falls with n, while the bus bandwidth stays put:

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
# These are gloo numbers for processes on one CPU host, where "the link" is memory copies
# through the kernel's loopback TCP. On GPUs, measure NCCL the same way (or with nccl-tests)
# and compare the bus bandwidth with the NVLink or network peak; the same two-term model
# applies.
#
# ## Summary
#
# - A distributed job is N independent processes. torchrun gives each `RANK`, `LOCAL_RANK`,
#   `WORLD_SIZE` and the rendezvous address; `init_process_group` meets the others through a
#   TCPStore there, then the backend (NCCL for CUDA, gloo for CPU) connects them directly.
# - Collectives are called by every rank of the group, in the same order, with matching
#   shapes. broadcast, all_reduce (SUM / AVG), reduce, all_gather, reduce_scatter,
#   all_to_all, send / recv and barrier cover everything this course does.
# - all-reduce = reduce-scatter + all-gather. The ring version moves 2(n-1)/n * S per rank,
#   so its bandwidth cost barely depends on n; its latency cost grows with n.
# - Time = latency + size / bandwidth. Bus bandwidth (nccl-tests) removes the n-dependence
#   of algorithm bandwidth so you can compare with hardware peaks.
# - DDP = all-reduce of gradients; FSDP = all-gather + reduce-scatter; TP = collectives inside
#   a layer; PP = send / recv between stages.
#
# ## Exercises
#
# Each exercise below is checked: it has a self-check (a Python block your answer must pass)
# and a worked answer, collapsed, in [the exercise book](../docs/onboarding-exercises.md).
#
# 1. **Bytes sent by a ring all-reduce**: the exact bytes each rank of `ring_all_reduce` sends
#    when n does not divide the tensor
#    ([onboarding exercise 0.1](../docs/onboarding-exercises.md#exercise-01-bytes-sent-by-a-ring-all-reduce)).
# 2. **Algorithm and bus bandwidth**: one all-reduce's seconds and bandwidths on 2 and 8 ranks,
#    from `comm_bench`'s bus bandwidth
#    ([onboarding exercise 0.2](../docs/onboarding-exercises.md#exercise-02-algorithm-and-bus-bandwidth)).
# 3. **What tensor parallel sends, and what DDP sends**: the bytes of the all-reduce in
#    `tp_pattern` and in `ddp_pattern`, and the batch at which they meet
#    ([onboarding exercise 0.3](../docs/onboarding-exercises.md#exercise-03-what-tensor-parallel-sends-and-what-ddp-sends)).
#
# ## If it breaks
#
# - A cell stops at `run_workers` and then raises `TimeoutError`: one rank did not join a
#   collective (a different order or count of calls on some rank) or died first; the timeout
#   turns the hang into an error. The runbooks ([index](../runbooks/index.md)) cover hangs and
#   timeouts in depth.
# - `RuntimeError` about mismatched sizes: the tensors passed to a collective must have the
#   same shape and dtype on every rank (`recv` buffers too).
# - An error that gloo does not support `reduce_scatter` or `ReduceOp.AVG`: a torch older than
#   2.8. The helpers here fall back automatically (`cw.GLOO_HAS_AVG_AND_REDUCE_SCATTER`); your
#   own code must do the same or use NCCL.
