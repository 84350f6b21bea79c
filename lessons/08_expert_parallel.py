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
# # 08 · Expert parallelism: a mixture of experts over ranks
#
# After this lesson you can:
#
# - build a top-k mixture-of-experts (MoE) layer: router, gates, capacity factor, token
#   dropping, and the auxiliary load-balancing loss;
# - spread its experts over ranks and move the tokens with two `all_to_all_single` calls of
#   uneven sizes, exchanging the counts first;
# - show that the expert-parallel layer computes what one process computes: outputs,
#   gradients, and the parameters after training, with and without dropped tokens;
# - measure the load per expert with and without the balancing loss, the tokens dropped
#   against the capacity factor, and the all-to-all bytes against the formula.
#
# Everything runs on a laptop CPU over gloo. Tested on torch 2.13.

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

import moe_workers as mw  # noqa: E402  (worker functions live in a module: spawn re-imports them)
from spawn import run_workers  # noqa: E402

torch.set_num_threads(1)

# %% [markdown]
# ## Why
#
# A mixture-of-experts layer replaces one MLP with E of them, the *experts*, and a small
# *router* that sends each token to k of them (here E = 8, k = 2). The model has E times the
# MLP parameters, but each token pays for only k experts' FLOPs. DeepSeek-V3 has 671B
# parameters and activates 37B per token; Mixtral 8x7B has 47B and activates 13B.
#
# The experts are what make the model big, so they are what gets spread: with expert
# parallelism (EP) of degree p, each rank holds E/p experts. A token then has to travel to
# the ranks of its experts and back. That is an all-to-all: every rank sends a different
# amount to every other rank, decided by the router at run time.

# %% [markdown]
# ## The layer, in one process
#
# The router scores every expert for every token, keeps the top k, and renormalises their
# probabilities into *gates*. Each expert has a fixed number of slots, its *capacity*:
# capacity factor x (tokens x k / E), the share a perfectly balanced router would send it.
# Tokens beyond capacity are *dropped* by that expert: their contribution is zero (in a
# transformer the residual connection still carries them on). Here is the whole layer:

# %%
print(inspect.getsource(mw.route))
print(inspect.getsource(mw.moe_reference))

# %% [markdown]
# The router learns from the gates alone, and a router that favours a few experts gets more
# of their gradient and favours them more. The Switch Transformer's auxiliary loss pushes
# back: E · Σ_e f_e · P_e, with f_e the share of routing choices that went to expert e and
# P_e its mean router probability. It is 1.0 for a uniform router and E/k when every token
# goes to the same k experts.

# %%
print(inspect.getsource(mw.balancing_loss))

# %% [markdown]
# ## Expert parallelism, by hand
#
# Rank r holds the r-th block of the batch's tokens and experts r·E/p to (r+1)·E/p - 1; the
# router is small and replicated. One forward pass:
#
# 1. **route** locally, and sort this rank's (token, choice) pairs by expert: that groups
#    them by destination rank too;
# 2. **exchange the counts** (`all_to_all_single` of a p x E/p table): each rank learns how
#    many tokens it will receive, from whom, for which expert;
# 3. **dispatch**: `all_to_all_single` of the token activations, with uneven splits;
# 4. each expert takes its tokens in global order (source rank, then token), keeps the first
#    `capacity`, and runs: the same tokens the one-process layer keeps;
# 5. **combine**: the reverse all-to-all, then the gates and a sum per token.
#
# The dispatch and combine must be differentiable: backward runs them again, reversed. torch
# 2.13's differentiable all-to-all is `torch.distributed._functional_collectives.all_to_all_single`
# (the older `torch.distributed.nn.functional` one is deprecated and points there).

# %%
print(inspect.getsource(mw.moe_expert_parallel))
print(inspect.getsource(mw.expert_outputs))

# %% [markdown]
# The balancing loss needs f_e and P_e over the *global* batch. f_e (counts) has no gradient,
# so an all-reduce of the counts is enough: each rank then adds its own tokens' term of
# Σ_e f_e · P_e, and the router's gradient, summed over the ranks like every replicated
# parameter's, is the global loss's.

# %%
print(inspect.getsource(mw.global_statistics))

# %% [markdown]
# ## Parity with one process
#
# 64 tokens, at 2 and 4 ranks, at two capacity factors: 1.0 (the router here is uneven, so
# some experts drop tokens) and 4.0 (nothing is dropped). Each run does one forward and
# backward (outputs, gradients), then 3 SGD steps with the balancing loss (parameters).

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
# The outputs are bit-identical: each token's output is the same products, summed in the
# same order, as in one process. The expert gradients are too, but the router's differ by
# about 1e-6: its gradient is summed over the ranks by an all-reduce, in a different order
# than one process sums it. After training the parameters agree to about 1e-7, and the
# tokens each expert dropped are the same ones.

# %% [markdown]
# ## Load per expert, with and without the balancing loss
#
# Start from a router that is already uneven (every token shares one direction, so most pick
# the same experts) and train 60 SGD steps at capacity factor 1.25, with the balancing loss
# weighted 0, 1 and 4. The routing is the same in one process as over p ranks (asserted
# above, step by step), so one process measures it here.

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
# Without the loss the rich get richer: the busiest expert's load grows and more than half
# the choices are dropped. With weight 4 the load evens out and almost nothing is dropped.
# Switch Transformer used a weight of 0.01; here the main loss is a tiny layer's squared
# error, whose gradient on the router is far larger than a language model's, so the weight
# that balances it is larger too. The weight is a ratio between two gradients, not a
# constant to copy.
#
# On a GPU cluster imbalance costs twice: dropped tokens lose quality, and the rank that
# holds the busiest experts computes longest while the others wait at the next all-to-all.

# %% [markdown]
# ## Tokens dropped against the capacity factor
#
# A perfectly balanced router drops max(0, 1 - capacity factor) of its choices. A real one
# drops more: every expert over capacity drops its excess, while the others' free slots stay
# unused. Measured on the skewed router (untrained) and on the one the balancing loss trained:

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
            assert stats["dropped"] == excess  # every expert drops exactly its excess
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
# Every measured curve sits on or above the balanced line, and the balanced router's curve
# hugs it. Capacity is memory and compute reserved for every expert, used or not: a factor
# of 1.25 to 2 is the usual compromise, and a good router is what makes a small one enough.
# (Some recent MoE models, DeepSeek-V3 for one, drop no tokens at all and balance with a
# bias on the router scores instead of an auxiliary loss.)

# %% [markdown]
# ## All-to-all bytes per step
#
# With a uniform router, a choice goes to another rank with probability (p-1)/p. A rank with
# T tokens then sends T·k·(p-1)/p activations of `dim` floats in the dispatch, and receives
# as many back in the combine; backward repeats both, reversed. Per rank and step:
#
# $$4 \cdot T k \frac{p-1}{p} \cdot \text{dim} \cdot 4\ \text{bytes}$$
#
# Measured from the splits of the parity runs above (64 tokens, dim 32, fp32):

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
# The mean over ranks lands within 25% of the uniform formula (the bound the cell asserts;
# the last figure of each line is this run's difference): with 64 tokens, how many choices
# happen to pick the rank's own experts, and stay home, varies from rank to rank. The formula is an expectation for a uniform
# router; an uneven router moves the mean too, up or down, depending on where its favourite
# experts live. At scale the numbers are large: with
# DeepSeek-V3's shape (dim 7168, k = 8) a token's dispatch is up to 8 x 7168 = 57,344 values
# per MoE layer, each way, which is why the all-to-all gets kernels of its own on GPU
# clusters (DeepSeek's DeepEP, for one).

# %% [markdown]
# ## What maps onto torchtitan, and what does not
#
# torchtitan's MoE (`torchtitan/models/moe/moe.py` and `torchtitan/distributed/expert_parallel.py`,
# read at commit 003edbe) follows the same steps: token-choice top-k routing
# (`TokenChoiceTopKRouter`), a stable argsort of the choices by expert (`TokenReorderer`, the
# same sort as step 1 here), a counts exchange, an uneven all-to-all from the same functional
# collectives module, the experts, and the reverse all-to-all. What differs:
#
# - its experts run as one grouped matmul (`torch._grouped_mm`) instead of a Python loop;
# - it has no capacity, so no token is dropped, and it balances the load with a bias added to
#   the router scores for the top-k choice only (`load_balance_coeff`, auxiliary-loss-free
#   balancing, arXiv:2408.15664, as in DeepSeek-V3) instead of an auxiliary loss;
# - its experts are DTensors on an `ep` mesh axis, composed with FSDP and TP, where this
#   lesson passes plain tensors and a process group (lab08, next, does the DTensor and FSDP
#   part).
#
# **GPU only, not executed in CI**: torchtitan's MoE on NCCL; the course has not run it.

# %% [markdown]
# ## In a whole model: lab08
#
# The lab trains the course's model with an MoE layer in place of every block's MLP (8
# experts, top-2), its experts spread over the "ep" axis of a ("dp", "ep") mesh and composed
# with FSDP2. The experts are DTensors, `Shard(0)` on "ep" (whole experts per rank), so a
# checkpoint keys them by their whole-model names and resumes on any layout; `fully_shard`
# splits their rows over "dp", and shards the dense layers over all ranks. Two details this
# lesson did not need:
#
# - **The experts' gradient divide factor.** On an ep rank, an expert's gradient already sums
#   the loss of every rank in its ep group: the backward all-to-all brings it home. FSDP then
#   reduces it over "dp" only, so the lab divides by dp x ep, the world size
#   (`set_gradient_divide_factor`), not by dp. With the default factor the parameters still
#   land near one process's, because AdamW divides each gradient by its own running scale;
#   that is why the lab also compares each step's gradient norm with one process.
# - **A global balancing loss.** The counts are all-reduced over every rank, so the loss's
#   value does not depend on how the batch is split, and a run resumed at another world size
#   still matches one process.
#
# Its `--check-parity` compares every parameter, each step's gradient norm and every
# expert's load with one process training the same batches:
#
# ```bash
# torchrun --standalone --nproc-per-node 4 labs/lab08_expert_parallel.py --ep 2 --check-parity
# ```

# %% [markdown]
# ## Summary
#
# - An MoE layer routes each token to k of E experts; capacity bounds each expert's tokens,
#   and the excess is dropped.
# - Expert parallelism spreads the experts; two uneven all-to-alls (after a counts exchange)
#   move the tokens there and back.
# - By hand on 2 and 4 ranks it matches one process: outputs exactly (asserted difference 0),
#   gradients and trained parameters within the asserted bound of 1e-5 (the cell prints the
#   measured differences), dropping the same tokens.
# - Without a balancing loss the router collapses onto few experts and drops most tokens;
#   with it the load evens out (measured above).
# - The all-to-all moves about 4·T·k·(p-1)/p·dim values per rank and step.
#
# ## Exercises
#
# - **Graded:** MoE dispatch and combine with all_to_all_single. Fill in `exercises/moe.py`, then run
#   `python exercises/grade.py moe`: it checks your code against one process, check by check
#   ([the exercises](../exercises/README.md)).
#
# Each exercise below is checked: it has a self-check (a Python block your answer must pass)
# and a worked answer, collapsed, in [the exercise book](../docs/onboarding-exercises.md).
#
# 1. **The dispatch's bytes**: what one MoE layer's dispatch sends per rank under a uniform
#    router, at DeepSeek's sizes too
#    ([onboarding exercise 8.1](../docs/onboarding-exercises.md#exercise-81-the-dispatchs-bytes)).
# 2. **The capacity that drops nothing**: the smallest capacity factor at which the layer drops
#    no token
#    ([onboarding exercise 8.2](../docs/onboarding-exercises.md#exercise-82-the-capacity-that-drops-nothing)).
# 3. **The splits only the counts can give**: the split sizes of the dispatch's all-to-all, and
#    which of them needs the counts exchange
#    ([onboarding exercise 8.3](../docs/onboarding-exercises.md#exercise-83-the-splits-only-the-counts-can-give)).
#
# ## If it breaks
#
# - A hang in the dispatch: the ranks disagree on the splits (one rank skipped the counts
#   exchange, or used stale counts). Every rank must call every all-to-all with the splits
#   the counts exchange gave it ([hangs and timeouts](../runbooks/collective-timeout.md)).
# - Parity off only in the router's gradient, by a factor of p: the balancing loss was
#   back-propagated whole on every rank instead of each rank's share.
