"""--plan: the memory each rank needs, by item, against the GPU it is planned for (or this
machine), and refusing before any process group a run whose estimate cannot fit.

The labs describe what a rank holds with plan_layout(cfg, world_size), a dict:
state_shards / optimizer_shards, the ranks that split each parameter's state; tp, the
tensor-parallel degree; layers, the blocks a rank holds; in_flight, the micro-batches whose
activations it holds at once; micro_batch, the sequences in each; fsdp, whether blocks are
gathered whole; ddp_buckets, DDP's copy of the gradients; mesh, what and precision, words
for the printout. Optional: reshard_after_forward (default true), whether FSDP frees a
block's gathered params after its forward; keeps_gathered, FSDP under pipelining (every
block of the stage stays gathered, with an unsharded gradient, all step long);
sequence_parallel, whether TP also splits the norms' activations; experts, (num_experts,
top_k, ep) for a mixture of experts in every block."""

import argparse
import math
import os
import sys

import torch

from labkit.errors import fail_config
from labkit.model import flops_per_token, parameter_shapes
from labkit.runtime import (choose_precision, compute_dtype, local_world_size, pick_device_type,
                            precision_name)

# Dense bf16 tensor-core peaks (no sparsity), as in torchtitan's get_peak_flops
# (torchtitan/tools/utils.py), from NVIDIA's datasheets; fp16 for the GPUs without bf16.
# Memory is the nominal size on the box. Keys are what --plan --gpu takes; "match" finds the
# entry for torch.cuda.get_device_name(): every token in the name's tokens, none of "unless"
# (first match wins, most specific first).
GPU_SPECS = {
    "B200-180GB": dict(match=("b200",), memory_gb=180, peak_flops=2.25e15, bf16=True),
    "H200-141GB": dict(match=("h200",), unless=("nvl",), memory_gb=141, peak_flops=989e12,
                       bf16=True),
    "H100-NVL-94GB": dict(match=("h100", "nvl"), memory_gb=94, peak_flops=835e12, bf16=True),
    "H100-PCIe-80GB": dict(match=("h100", "pcie"), memory_gb=80, peak_flops=756e12, bf16=True),
    "H100-80GB": dict(match=("h100",), memory_gb=80, peak_flops=989e12, bf16=True),
    "A100-80GB": dict(match=("a100", "80gb"), memory_gb=80, peak_flops=312e12, bf16=True),
    "A100-40GB": dict(match=("a100",), memory_gb=40, peak_flops=312e12, bf16=True),
    "L40S-48GB": dict(match=("l40s",), memory_gb=48, peak_flops=362e12, bf16=True),
    "L4-24GB": dict(match=("l4",), memory_gb=24, peak_flops=121e12, bf16=True),
    "V100-32GB": dict(match=("v100", "32gb"), memory_gb=32, peak_flops=125e12, bf16=False),
    "T4-16GB": dict(match=("t4",), memory_gb=16, peak_flops=65e12, bf16=False),
}


def gpu_spec_for(device_name):
    """(key, spec) of GPU_SPECS for a device name, or (None, None): no guess for an unknown GPU.
    Whole tokens of the name, not substrings: "NVIDIA L40" is not an L4, "GH200" not an H200."""
    tokens = set("".join(c if c.isalnum() else " " for c in device_name.lower()).split())
    for key, spec in GPU_SPECS.items():
        if set(spec["match"]) <= tokens and not set(spec.get("unless", ())) & tokens:
            return key, spec
    return None, None


MEMORY_LEFT_OUT = (
    "the CUDA context and NCCL's buffers (about 0.5-1 GB per process)",
    "allocator fragmentation and cached-but-free blocks",
    "temporaries inside one op (attention workspace, the optimizer's foreach buffers)",
    "a checkpoint's staging copies while it is saved",
)
GATHERED = "gathered (FSDP)"  # the item of what FSDP holds unsharded: gathered_bytes()
FIT_FRACTION = 0.9  # the estimate may fill 90% of a device; the rest is for MEMORY_LEFT_OUT


def device_capacity_bytes(device_type, num_local_ranks):
    """What one rank may use: its GPU's memory, or an even share of this machine's RAM."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // num_local_ranks


def activation_elements_per_token(cfg, experts=None):
    """Elements one block saves for backward per token, counted from Block.forward with a fused
    (flash) attention that keeps no seq x seq scores: the norms' inputs and outputs, q/k/v
    before and after RoPE, the attention output, and SwiGLU's four hidden-width tensors.
    experts, (num_experts, top_k, load): for each of a token's top_k routing choices, the
    experts' input row and SwiGLU's tensors, times load (the most of the even share of tokens
    an ep rank's experts may receive: --capacity-factor, or 1.0, an even router, without
    one), and the combined output row; and the router's probabilities. Measured on CPU
    (tests/test_plan_measured.py): within 7% above what autograd really saves per block."""
    kv_dim = cfg.num_kv_heads * (cfg.dim // cfg.num_heads)
    attention = 9 * cfg.dim + 3 * kv_dim
    if experts is None:
        return attention + 4 * cfg.ffn_dim
    num_experts, top_k, load = experts
    routed = (4 * cfg.ffn_dim + cfg.dim) * load + cfg.dim
    return int(attention + top_k * routed + num_experts)


def replicated_elements_per_token(cfg):
    """Of those, what tensor parallel without sequence parallel leaves whole on every tp rank:
    the two norms' inputs and outputs (Korthikanti et al., arXiv:2205.05198, Table 2: the terms
    only sequence parallel divides)."""
    return 4 * cfg.dim


def block_sizes(cfg, layout, shapes):
    """(parameters of one block, the part of them one rank gathers at once), as the lab's model
    has them (shapes: the dense model's, parameter_shapes(cfg)): with experts, every expert
    counts in the block, and a rank gathers its ep group's share of them (FSDP shards them
    over dp only)."""
    block = sum(math.prod(s) for n, s in shapes.items() if n.startswith("layers.0."))
    if "experts" not in layout:
        return block, block
    num_experts, _, ep = layout["experts"]
    mlp = 3 * cfg.dim * cfg.ffn_dim  # w1, w2, w3 of one expert
    dense = block - mlp + cfg.dim * num_experts  # attention, norms, the router
    return dense + num_experts * mlp, dense + num_experts // ep * mlp


def expert_routing(cfg, layout):
    """(num_experts, top_k, load) of a mixture of experts (see activation_elements_per_token),
    or None for a dense model."""
    if "experts" not in layout:
        return None
    num_experts, top_k, _ = layout["experts"]
    return num_experts, top_k, getattr(cfg, "capacity_factor", 0) or 1.0


def unbounded_routing(cfg, layout):
    """What the activations leave out for a mixture of experts without a capacity cap."""
    if "experts" in layout and not getattr(cfg, "capacity_factor", 0):
        return ("the tokens an unbalanced router sends an ep rank beyond its even share "
                "(no --capacity-factor to bound them)",)
    return ()


def gathered_bytes(cfg, layout, unit, root, compute_bytes):
    """(bytes, words) FSDP holds unsharded at the step's peak, params in the compute dtype and
    gradients in fp32. unit: the params one block gathers; root: those outside the blocks,
    which the root keeps gathered from forward to the end of backward. The larger of:
    - forward: the root, the block computing and the one prefetched (every block, with
      reshard_after_forward=False), and the buffer of the last all-gather, which FSDP keeps
      until the next one is copied out; with gradient accumulation, the unsharded gradients
      of the micro-steps before (set_requires_gradient_sync(False) keeps every block's);
    - backward: the root and two blocks (one computing, one prefetched), with gradients
      (every block's, with accumulation).
    Under pipelining every block of the stage stays gathered with its gradient all step:
    torch/distributed/pipelining/stage.py holds back FSDP's reshard and gradient sync until
    the last microbatch. Checked against torch's FSDPMemTracker on CPU
    (tests/test_plan_measured.py)."""
    layers, c = layout["layers"], compute_bytes
    if layout.get("keeps_gathered"):
        return (root + layers * unit) * (c + 4), "the root and the whole stage, with gradients"
    forward_blocks = 2 if layout.get("reshard_after_forward", True) else layers
    grad_blocks = layers if getattr(cfg, "grad_accum", 1) > 1 else 0
    forward = (root + forward_blocks * unit + max(root, unit)) * c
    forward += (root + grad_blocks * unit) * 4 if grad_blocks else 0
    backward = (root + 2 * unit) * c + (root + max(grad_blocks, 2) * unit) * 4
    grads = ", every block's gradient" if grad_blocks else ""
    if forward > backward:
        return forward, (f"in forward, the root, {forward_blocks} blocks, the last all-gather's "
                         f"buffer{grads}")
    return backward, "in backward, the root and two blocks, with gradients" + grads


def model_sizes(cfg, layout):
    """(params of one block, the part of them one rank gathers at once, params outside the
    blocks), from the dense model's shapes and the layout (block_sizes)."""
    shapes = parameter_shapes(cfg)
    outside = sum(math.prod(s) for n, s in shapes.items() if not n.startswith("layers."))
    return (*block_sizes(cfg, layout, shapes), outside)


def estimate_memory(cfg, layout, dtype):
    """Bytes the busiest rank needs, by item (AdamW, fp32 master weights and gradients), for
    the lab's plan_layout (see the module docstring)."""
    block, gathered_block, outside = model_sizes(cfg, layout)
    held = layout["layers"] * block + outside
    compute_bytes = 4 if dtype is None else 2
    tokens = layout["micro_batch"] * cfg.seq_len
    tp = layout["tp"]
    per_token = activation_elements_per_token(cfg, expert_routing(cfg, layout))
    whole = 0 if layout.get("sequence_parallel") or tp == 1 else replicated_elements_per_token(cfg)
    per_block_act = (whole + (per_token - whole) / tp) * tokens * compute_bytes
    stored_blocks = 1 if getattr(cfg, "activation_checkpointing", False) else layout["layers"]
    checkpointed = (layout["layers"] - stored_blocks) * cfg.dim * tokens * compute_bytes
    gathered, _ = gathered_bytes(cfg, layout, gathered_block, outside, compute_bytes)
    items = {
        "params (fp32)": 4 * held // layout["state_shards"],
        "grads (fp32)": 4 * held // layout["state_shards"],
        "AdamW state (2 x fp32)": 8 * held // layout["optimizer_shards"],
        "DDP gradient buckets": 4 * held if layout["ddp_buckets"] else 0,
        GATHERED: gathered // tp if layout["fsdp"] else 0,
        "activations": int(layout["in_flight"] * (stored_blocks * per_block_act + checkpointed)),
        # Logits in the compute dtype, their fp32 copy for the loss, and its gradient.
        "logits and loss": tokens * cfg.vocab_size * (compute_bytes + 8),
    }
    return {name: value for name, value in items.items() if value}


def check_fits(cfg, layout, dtype, capacity, label):
    """Refuse a run whose estimate cannot fit, before any process group: one line, exit 2."""
    items = estimate_memory(cfg, layout, dtype)
    need = sum(items.values())
    if need > FIT_FRACTION * capacity:
        biggest = max(items, key=items.get)
        fail_config("--model", f"{cfg.model} needs about {need / 1e9:.1f} GB per rank "
                    f"({biggest}: {items[biggest] / 1e9:.1f} GB), {label} has "
                    f"{capacity / 1e9:.1f} GB: see --plan, or choose a smaller --model")


def plan_target(cfg, world_size):
    """(label, capacity per rank, dtype, peak FLOP/s) of the hardware a plan is for."""
    if cfg.gpu:
        spec = GPU_SPECS[cfg.gpu]
        dtype = choose_precision(cfg.amp, "cuda", spec["bf16"])
        return (f"{world_size} x {cfg.gpu}", spec["memory_gb"] * 1e9, dtype, spec["peak_flops"])
    device_type = pick_device_type(cfg)
    if device_type == "cuda" and not torch.cuda.is_available():
        fail_config("--gpu", "no GPU on this machine to plan for: name one, e.g. --gpu H100-80GB")
    capacity = device_capacity_bytes(device_type, min(world_size, local_world_size()) or 1)
    return (f"{world_size} x this machine's {device_type}", capacity,
            compute_dtype(cfg, device_type), None)


def print_plan(cfg, layout, world_size):
    label, capacity, dtype, peak = plan_target(cfg, world_size)
    items = estimate_memory(cfg, layout, dtype)
    need, num_params = sum(items.values()), sum(math.prod(s) for s in parameter_shapes(cfg).values())
    fits = need <= FIT_FRACTION * capacity
    lines = [f"plan | {cfg.lab} | {label} | --model {cfg.model}: {num_params / 1e9:.2f}B params, "
             f"seq {cfg.seq_len}, micro-batch {cfg.micro_batch_size}, global batch {cfg.batch_size}",
             f"mesh: {layout['mesh']} ({layout['what']})",
             f"precision: {precision_name(dtype)} compute; {layout['precision']}",
             f"FLOPs per token: {flops_per_token(cfg, cfg.seq_len) / 1e9:.1f} GFLOP"
             + (f"; peak {peak / 1e12:.0f} TFLOP/s per GPU" if peak else ""),
             "memory per rank (estimate, the busiest rank):"]
    lines += [f"  {name:28s} {value / 1e9:8.2f} GB" for name, value in items.items()]
    if GATHERED in items:
        _, unit, root = model_sizes(cfg, layout)
        words = gathered_bytes(cfg, layout, unit, root, 4 if dtype is None else 2)[1]
        lines.append(f"  ({GATHERED}: {words})")
    lines += [f"  {'total':28s} {need / 1e9:8.2f} GB of {capacity / 1e9:.1f} GB: "
              f"{'fits' if fits else 'does NOT fit'} (limit {FIT_FRACTION:.0%})",
              "not counted: " + "; ".join(MEMORY_LEFT_OUT + unbounded_routing(cfg, layout))]
    if not fits and getattr(cfg, "activation_checkpointing", True) is False:
        recompute = argparse.Namespace(**{**vars(cfg), "activation_checkpointing": True})
        total = sum(estimate_memory(recompute, layout, dtype).values())
        lines.append(f"with --activation-checkpointing: {total / 1e9:.2f} GB, "
                     f"{'fits' if total <= FIT_FRACTION * capacity else 'still does NOT fit'}")
    print("\n".join(lines))
    return fits


def plan_or_refuse(cfg, layout, world_size):
    """--plan: print the plan, exit 0. Otherwise refuse a run whose estimate cannot fit."""
    if cfg.plan:
        print_plan(cfg, layout, world_size)
        sys.exit(0)
    device_type = pick_device_type(cfg)
    capacity = device_capacity_bytes(device_type, local_world_size())
    check_fits(cfg, layout, compute_dtype(cfg, device_type), capacity,
               f"this machine's {device_type}")
