"""The "which parallelism when" page, with every memory figure computed by
labs/memory_estimator.py and every throughput figure by labs/perf_model.py (nothing typed by
hand). Its prose is tools/templates/which-parallelism.md (and the Chinese template); the pages
are committed, so that a link to them works on a code host too, and a test checks they are
what this makes. After editing a template or a model, rewrite them:

    python tools/decision_guide.py
"""

import importlib.util
import sys
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


# The words inside the generated tables, in each language.
LABELS = {"fits": "fits", "too big": "too big", "does not fit": "does not fit", "to": "to",
          "comm": "comm", "model": "model", "GPUs": "GPUs",
          "compute per step at peak": "compute per step at peak",
          "tok/s per GPU": "tok/s per GPU"}
LABELS_ZH = {"fits": "放得下", "too big": "放不下", "does not fit": "放不下", "to": "至",
             "comm": "通信", "model": "模型", "GPUs": "GPU 数",
             "compute per step at peak": "峰值下每步计算时间", "tok/s per GPU": "每 GPU tok/s"}


def cell(gb, labels):
    shown = f"{gb:,.1f}" if gb >= 1 else f"{gb:.2f}"
    mark = labels["fits"] if gb <= BUDGET * GPU_GB else f"**{labels['too big']}**"
    return f"{shown} GB ({mark})"


def memory_table(labels):
    header = f"| {labels['model']} | {labels['GPUs']} | DDP | ZeRO-1 | ZeRO-2 | FSDP (ZeRO-3) |"
    rows = [header, "|---|---|---|---|---|---|"]
    for name, num_params in MODELS.items():
        for world_size in WORLD_SIZES:
            cells = [cell(per_gpu_gb(num_params, world_size, s), labels)
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


def throughput_cell(model, world_size, strategy, labels):
    if per_gpu_gb(MODELS[model], world_size, {"ddp": "ddp", "fsdp": "zero3"}[strategy]) > \
            BUDGET * GPU_GB:
        return labels["does not fit"]
    step = predicted_step(model, world_size, strategy)
    return (f"{step['overlapped_tokens_per_s']:,.0f} {labels['to']} "
            f"{step['exposed_tokens_per_s']:,.0f} ({labels['comm']} {step['comm_s']:.2f} s)")


def comm_ratio(link_bytes_per_s):
    """Communication over compute per step at the peak, for 8 bytes of traffic per parameter
    and the ring factor (n-1)/n taken as 1."""
    return 8 * PEAK_FLOPS / link_bytes_per_s / (6 * TOKENS_PER_GPU)


def throughput_table(labels):
    header = (f"| {labels['model']} (layers x width) | {labels['GPUs']} | "
              f"{labels['compute per step at peak']} | DDP: {labels['tok/s per GPU']} "
              f"| FSDP: {labels['tok/s per GPU']} |")
    rows = [header, "|---|---|---|---|---|"]
    for model in MODELS:
        for world_size in WORLD_SIZES:
            compute_s = predicted_step(model, world_size, "fsdp")["compute_s"]
            layers, dim = SHAPES[model]
            rows.append(f"| {model} ({layers} x {dim}) | {world_size} | {compute_s:.2f} s | "
                        f"{throughput_cell(model, world_size, 'ddp', labels)} | "
                        f"{throughput_cell(model, world_size, 'fsdp', labels)} |")
    return "\n".join(rows)


TEMPLATE = ROOT / "tools" / "templates" / "which-parallelism.md"


def template_values(labels):
    """Every figure the page's prose quotes, computed now; `labels` are the tables' words."""
    return {
        "ddp_bytes_per_param": f"{per_gpu_gb(1e9, 1, 'ddp'):.0f}",
        "budget": f"{BUDGET:.0%}",
        "gpu_gb": f"{GPU_GB}",
        "memory_table": memory_table(labels),
        "peak_tflops": f"{PEAK_FLOPS / 1e12:.0f}",
        "nvlink_gb_s": f"{NVLINK_BYTES_PER_S / 1e9:.0f}",
        "gpus_per_node": f"{GPUS_PER_NODE}",
        "nic_gb_s": f"{NIC_BYTES_PER_S / 1e9:.0f}",
        "sequences_per_gpu": f"{TOKENS_PER_GPU // SEQ_LEN}",
        "seq_len": f"{SEQ_LEN}",
        "throughput_table": throughput_table(labels),
        "ratio_in_node": f"{comm_ratio(NVLINK_BYTES_PER_S):.2f}",
        "ratio_across_nodes": f"{comm_ratio(NIC_BYTES_PER_S):.2f}",
        "tokens_per_gpu": f"{TOKENS_PER_GPU:,}",
        "bound_below_percent": f"{100 / comm_ratio(NIC_BYTES_PER_S):.0f}",
        "gb_70b_on_64": f"{per_gpu_gb(70e9, 64, 'zero3'):.1f}",
    }


def page(template=TEMPLATE, labels=None):
    """The page from its prose template (English here; the Chinese edition passes its own
    template and table words)."""
    return Path(template).read_text().format(**template_values(labels or LABELS))


GENERATED = ("<!-- Generated by tools/decision_guide.py from its template in tools/templates/ "
             "(i18n/zh/tools/templates/ for Chinese): edit that, then rerun it. -->\n")
PAGE = ROOT / "docs" / "reference" / "which-parallelism.md"
ZH_PAGE = ROOT / "i18n" / "zh" / "docs" / "reference" / "which-parallelism.md"
ZH_TEMPLATE = ROOT / "i18n" / "zh" / "tools" / "templates" / "which-parallelism.md"


def pages():
    """{path: text} of the committed pages, as this module makes them now."""
    return {PAGE: GENERATED + page(), ZH_PAGE: GENERATED + page(ZH_TEMPLATE, LABELS_ZH)}


def main():
    for path, text in pages().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
