"""The "which parallelism when" page, with every memory figure computed by
labs/memory_estimator.py when the site is built (nothing typed by hand)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_GB = 80  # an 80 GB accelerator (H100 / A100-80GB class)
BUDGET = 0.5  # share of it the persistent state may take: the rest is activations and buffers
MODELS = {"1B": 1e9, "8B": 8e9, "70B": 70e9, "405B": 405e9}
WORLD_SIZES = (8, 64, 512)
# Mixed precision as usually trained: bf16 params and grads, fp32 AdamW moments and an fp32
# master copy of the params (2 + 2 + 4 + 4 + 4 = 16 bytes per parameter under DDP).
MIXED = {"param_bytes": 2, "grad_bytes": 2, "optimizer": "adamw", "optimizer_state_bytes": 4,
         "master_weights": True}


def estimator():
    spec = importlib.util.spec_from_file_location("memory_estimator",
                                                  ROOT / "labs" / "memory_estimator.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_gpu_gb(num_params, world_size, strategy):
    return estimator().estimate_per_rank(num_params, world_size, strategy, **MIXED).total_bytes / 1e9


def cell(gb):
    shown = f"{gb:,.1f}" if gb >= 1 else f"{gb:.2f}"
    mark = "fits" if gb <= BUDGET * GPU_GB else "**too big**"
    return f"{shown} GB ({mark})"


def memory_table():
    header = "| model | GPUs | DDP | ZeRO-1 | ZeRO-2 | FSDP (ZeRO-3) |"
    rows = [header, "|---|---|---|---|---|---|"]
    for name, num_params in MODELS.items():
        for world_size in WORLD_SIZES:
            cells = [cell(per_gpu_gb(num_params, world_size, s))
                     for s in ("ddp", "zero1", "zero2", "zero3")]
            rows.append(f"| {name} | {world_size} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def page():
    return f"""# Which parallelism when

Start from memory, because that is what forces your hand first. The table is computed by
`labs/memory_estimator.py` when this site is built (lesson 02 checks the estimator against what
the ranks of lab02 hold, within 5%). It counts the state that lives between steps, per GPU,
for mixed precision as usually trained: bf16 parameters and gradients, fp32 AdamW moments and an fp32 master
copy ({per_gpu_gb(1e9, 1, "ddp"):.0f} bytes per parameter under DDP). "fits" means at most {BUDGET:.0%} of an {GPU_GB} GB GPU: the other half
is a rough allowance for activations, the unsharded layer FSDP gathers, communication buffers and
fragmentation. That allowance is a rule of thumb, not a measurement: check yours with the
[memory snapshot runbook](../runbooks/oom-memory-snapshots.md).

{memory_table()}

Your model: `python labs/memory_estimator.py --params 8e9 --world-size 8 --param-bytes 2
--grad-bytes 2 --master-weights`.

## The order to try them in

Guidance, not executed in CI: what each step costs is measured in the lessons, but when to switch
depends on your hardware.

1. **DDP** ([lab01](../labs/lab01_ddp.md)) while the DDP column fits. Simplest and usually
   fastest: one gradient all-reduce per step, overlapped with backward.
2. **FSDP** ([lab02](../labs/lab02_fsdp.md)) when it does not. The state per GPU falls as 1/N
   (the FSDP column); the price is an all-gather of each layer's parameters in forward and again in
   backward, and a reduce-scatter of gradients: about 1.5x DDP's traffic (lesson 02 explains).
   ZeRO-1 and ZeRO-2 sit in between: in PyTorch, `ZeroRedundancyOptimizer` shards the optimizer
   state (ZeRO-1), and `fully_shard(..., reshard_after_forward=False)` keeps parameters gathered
   between forward and backward, which trades memory for one all-gather less (ZeRO-2-like).
3. **Tensor parallel inside a node + FSDP across nodes** ([lab03](../labs/lab03_tp_fsdp.md))
   when FSDP alone would need so many GPUs that the global batch (micro-batch x GPUs) grows past
   what the model trains well with, or when one layer's unsharded weights and activations no
   longer fit. TP talks inside every layer, so keep it on the fast links within a node.
4. **Pipeline parallel** ([lab04](../labs/lab04_pipeline.md)) across nodes when the links between
   nodes are slow or the model is too deep for the above. It sends only activations between
   stages, but idles a fraction (p - 1) / (m + p - 1) of each step (p stages, m micro-batches):
   lesson 04 measures that bubble for every schedule.

The table also shows why step 2 comes before step 3: at 70B on 64 GPUs, FSDP alone already brings
the state to {per_gpu_gb(70e9, 64, "zero3"):.1f} GB per GPU.
"""
