"""The "which parallelism when" page, with every memory figure computed by
labs/memory_estimator.py and every throughput figure by labs/perf_model.py when the site is
built (nothing typed by hand)."""

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


# Throughput assumptions (datasheet figures, not measurements): H100 SXM bf16 dense peak;
# NVLink 450 GB/s each way inside an 8-GPU node; one 400 Gb/s InfiniBand NIC per GPU (50 GB/s)
# once a ring leaves the node. Local batch: 2 sequences of 8192 tokens per GPU (torchtitan's
# Llama 3.1 8B benchmark). Llama 3 shapes (layers, width) for the attention FLOPs.
PEAK_FLOPS = 989e12
NVLINK_BYTES_PER_S, NIC_BYTES_PER_S = 450e9, 50e9
GPUS_PER_NODE = 8
SEQ_LEN, TOKENS_PER_GPU = 8192, 2 * 8192
SHAPES = {"1B": (16, 2048), "8B": (32, 4096), "70B": (80, 8192), "405B": (126, 16384)}


def load_lab_module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "labs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def estimator():
    return load_lab_module("memory_estimator")


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


def flop_per_token(model):
    """The labs' formula (lesson 06): 6 per weight, plus attention's 12 x layers x width x seq."""
    layers, dim = SHAPES[model]
    return 6 * MODELS[model] + 12 * layers * dim * SEQ_LEN


def predicted_step(model, world_size, strategy):
    link = NVLINK_BYTES_PER_S if world_size <= GPUS_PER_NODE else NIC_BYTES_PER_S
    return load_lab_module("perf_model").datasheet_tokens_per_s(
        strategy, MODELS[model], flop_per_token(model), TOKENS_PER_GPU, world_size, PEAK_FLOPS,
        link)


def throughput_cell(model, world_size, strategy):
    if per_gpu_gb(MODELS[model], world_size, {"ddp": "ddp", "fsdp": "zero3"}[strategy]) > \
            BUDGET * GPU_GB:
        return "does not fit"
    step = predicted_step(model, world_size, strategy)
    return (f"{step['overlapped_tokens_per_s']:,.0f} to {step['exposed_tokens_per_s']:,.0f} "
            f"(comm {step['comm_s']:.2f} s)")


def comm_ratio(link_bytes_per_s):
    """Communication over compute per step at the peak, for 8 bytes of traffic per parameter
    and the ring factor (n-1)/n taken as 1."""
    return 8 * PEAK_FLOPS / link_bytes_per_s / (6 * TOKENS_PER_GPU)


def throughput_table():
    header = ("| model (layers x width) | GPUs | compute per step at peak | DDP: tok/s per GPU "
              "| FSDP: tok/s per GPU |")
    rows = [header, "|---|---|---|---|---|"]
    for model in MODELS:
        for world_size in WORLD_SIZES:
            compute_s = predicted_step(model, world_size, "fsdp")["compute_s"]
            layers, dim = SHAPES[model]
            rows.append(f"| {model} ({layers} x {dim}) | {world_size} | {compute_s:.2f} s | "
                        f"{throughput_cell(model, world_size, 'ddp')} | "
                        f"{throughput_cell(model, world_size, 'fsdp')} |")
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

## Throughput: what the step-time model predicts

Predicted by `labs/perf_model.py` (`datasheet_tokens_per_s`) when this site is built, for the
layouts of the memory table that fit. Each cell gives tokens per second per GPU with the
communication hidden behind compute, then with it exposed (nothing overlapped), and the
communication time per step. Assumptions, all datasheet figures and none measured here:
H100 SXM at its {PEAK_FLOPS / 1e12:.0f} TFLOP/s bf16 dense peak; NVLink at
{NVLINK_BYTES_PER_S / 1e9:.0f} GB/s each way inside a node of {GPUS_PER_NODE}; beyond one node,
every ring runs at one 400 Gb/s NIC per GPU ({NIC_BYTES_PER_S / 1e9:.0f} GB/s); a local batch
of {TOKENS_PER_GPU // SEQ_LEN} sequences of {SEQ_LEN} tokens; bf16 all-gathers and fp32
gradient reductions; FLOPs per token from the labs' formula with Llama 3's shapes.

{throughput_table()}

Read the compute column as a floor and the tokens per second as a ceiling: they assume every
FLOP at the peak. A published run reaches about a third of it: torchtitan's Llama 3.1 8B FSDP
benchmark on 8 H100s reports 5,762 tokens per second per GPU, 34% MFU (lesson 06 sets the
prediction beside it and explains the gap).

What the table does say is the ratio of communication to compute. Both grow with the
parameter count, so the ratio hardly depends on the model: it is about
8 bytes x (peak / link) / (6 x tokens per GPU), {comm_ratio(NVLINK_BYTES_PER_S):.2f} inside a node and
{comm_ratio(NIC_BYTES_PER_S):.2f} across nodes here. Above 1, overlap cannot hide the traffic at the
peak: across nodes, with {TOKENS_PER_GPU:,} tokens per GPU per step, FSDP and DDP are
communication bound until the kernels run below {100 / comm_ratio(NIC_BYTES_PER_S):.0f}% of the peak, or until
each GPU processes more tokens per step (a larger local batch).

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
5. **Context parallel** ([lesson 07](../lessons/07_context_parallel.ipynb)) when the
   sequence is long enough that one sample's activations no longer fit, whatever the other
   axes do: none of them splits the sequence. Each rank keeps S/p tokens (lesson 07 measures
   the saved activations per rank at exactly 1/p); the price is a ring of key/value slices in
   every attention layer, about 2.75 times the sequence's keys and values per layer and step
   at p = 4 with the backward pass (exercise 7.2), so keep the ring inside a node. Use the
   head-tail split with causal attention: the naive split leaves the last rank the most work.
6. **Expert parallel** ([lesson 08](../lessons/08_expert_parallel.ipynb)) for a
   mixture-of-experts model, whose experts are most of its parameters: spread them over an
   `ep` axis. Each MoE layer then does two all-to-alls forward and two backward, about
   4 x tokens x k x (p - 1) / p x dim values per rank (lesson 08 measures them), and is as
   fast as its busiest expert, so the router must be balanced.

The table also shows why step 2 comes before step 3: at 70B on 64 GPUs, FSDP alone already brings
the state to {per_gpu_gb(70e9, 64, "zero3"):.1f} GB per GPU.
"""
