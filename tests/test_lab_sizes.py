"""Model sizes that matter, on a laptop: the --model presets, the memory estimate that refuses
what cannot fit (one line, exit 2, before any process group), --plan for hardware this
machine does not have, and the FLOPs per token behind every lab's MFU."""

import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit import metrics, plan
from labkit import model as kit_model
from launcher import LABS, PYTHON, load_script, run_all

sys.path.insert(0, str(LABS))
import memory_estimator  # noqa: E402  (the course's stand-alone estimator)

LAB_PATHS = sorted(LABS.glob("lab[0-9][0-9]_*.py"))
PLAN_8B = ["--plan", "--model", "8b", "--nproc", "8", "--gpu", "H100-80GB"]


@pytest.fixture(scope="module")
def lab02():
    return load_script(LABS / "lab02_fsdp.py")


def config(lab, args, monkeypatch):
    """parse_config without the fit check: an 8b config on a laptop, to count it."""
    monkeypatch.setattr(lab, "plan_or_refuse", lambda *a: None)
    return lab.parse_config(args)


def num_params(lab, args, monkeypatch):
    shapes = kit_model.parameter_shapes(config(lab, args, monkeypatch))
    return sum(torch.Size(s).numel() for s in shapes.values())


def test_presets_have_the_published_shapes(lab02, monkeypatch):
    # Llama-3.1-8B: 8,030,261,248 parameters (its config.json: dim 4096, 32 layers, 32 heads,
    # 8 kv heads, ffn 14336, vocab 128256).
    assert num_params(lab02, ["--model", "8b"], monkeypatch) == 8_030_261_248
    # Llama-3.2-1B ties its output to the embedding (1,235,814,400); ours is untied.
    untied = num_params(lab02, ["--model", "1b"], monkeypatch)
    assert untied - 128256 * 2048 == 1_235_814_400
    assert num_params(lab02, [], monkeypatch) == 139_584
    assert num_params(lab02, ["--model", "debug"], monkeypatch) == 139_584


def test_debug_is_the_old_default_model(lab02):
    cfg = lab02.parse_config([])
    assert (cfg.dim, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_dim,
            cfg.vocab_size, cfg.seq_len, cfg.micro_batch_size) == (64, 2, 4, 4, 256, 64, 32, 8)
    assert lab02.parse_config(["--dim", "128"]).ffn_dim == 512  # follows --dim, as before


def test_a_preset_field_can_be_overridden(lab02):
    cfg = lab02.parse_config(["--model", "small", "--num-layers", "2", "--seq-len", "64"])
    assert (cfg.dim, cfg.num_layers, cfg.seq_len, cfg.num_kv_heads) == (256, 2, 64, 4)


BAD_PLAN_INPUTS = [
    (["--plan", "--gpu", "X100"], "--gpu"),
    (["--gpu", "H100-80GB"], "--gpu"),      # --gpu without --plan means nothing
    (["--nproc", "8"], "--nproc"),
]


def plain_commands():
    """{name: command} for every lab run here as a plain process that believes it is one of 2
    (as torchrun would say): its checks run, and it must exit before any process group."""
    commands = {}
    for lab_path in LAB_PATHS:
        extra = ["--microbatches", "8"] if "pipeline" in lab_path.stem else []
        commands[("too big", lab_path.stem)] = [PYTHON, str(lab_path), "--model", "8b"]
        commands[("plan", lab_path.stem)] = [PYTHON, str(lab_path), *PLAN_8B, *extra]
    for args, _ in BAD_PLAN_INPUTS:
        commands[("bad", *args)] = [PYTHON, str(LABS / "lab02_fsdp.py"), *args]
    return commands


@pytest.fixture(scope="module")
def plain_runs():
    """Every plain_commands() run, side by side (launcher.run_all): {name: finished process}."""
    commands = plain_commands()
    procs = run_all(list(commands.values()), timeout=120,
                    envs=[{"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}] * len(commands))
    return dict(zip(commands, procs))


@pytest.mark.parametrize("lab_path", LAB_PATHS, ids=lambda p: p.stem)
def test_a_model_too_big_for_this_machine_is_refused_before_any_process_group(lab_path,
                                                                               plain_runs):
    proc = plain_runs[("too big", lab_path.stem)]
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--model: 8b needs about" in lines[0] and "GB per rank" in lines[0]
    assert "see --plan" in lines[0]


def test_plan_8b_on_8_h100_starts_no_process_group(lab02, monkeypatch, capsys):
    def forbidden(*args, **kwargs):
        raise AssertionError("--plan started a process group")

    monkeypatch.setattr(torch.distributed, "init_process_group", forbidden)
    monkeypatch.setattr(torch.distributed, "TCPStore", forbidden)
    with pytest.raises(SystemExit) as exit_info:
        lab02.main(PLAN_8B)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "plan | lab02_fsdp | 8 x H100-80GB | --model 8b: 8.03B params, seq 8192" in out
    assert "mesh: dp=8 (fully_shard, one unit per block)" in out
    assert "precision: bf16 compute; MixedPrecisionPolicy" in out
    assert "not counted: the CUDA context" in out
    assert "with --activation-checkpointing:" in out and ", fits" in out


def test_the_plan_state_bytes_agree_with_the_course_estimator(lab02, monkeypatch):
    """The lab's estimate of params, grads and AdamW state per rank is memory_estimator.py's
    ZeRO-3 figure (the estimator lesson 02 checks against measured bytes)."""
    cfg = config(lab02, ["--model", "8b", "--plan", "--nproc", "8"], monkeypatch)
    items = plan.estimate_memory(cfg, lab02.plan_layout(cfg, 8), torch.bfloat16)
    total = num_params(lab02, ["--model", "8b"], monkeypatch)
    expected = memory_estimator.estimate_per_rank(total, 8, "zero3")
    assert items["params (fp32)"] == expected.params_bytes
    assert items["grads (fp32)"] == expected.grads_bytes
    assert items["AdamW state (2 x fp32)"] == expected.optimizer_bytes


@pytest.mark.parametrize("lab_path", LAB_PATHS, ids=lambda p: p.stem)
def test_every_lab_plans_an_8b_run(lab_path, plain_runs):
    proc = plain_runs[("plan", lab_path.stem)]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"plan | {lab_path.stem} | 8 x H100-80GB" in proc.stdout
    assert "memory per rank (estimate, the busiest rank):" in proc.stdout
    assert "GB of 80.0 GB: " in proc.stdout and "(limit 90%)" in proc.stdout


@pytest.mark.parametrize("args, flag", BAD_PLAN_INPUTS)
def test_bad_plan_input_is_one_line_and_exit_2(args, flag, plain_runs):
    proc = plain_runs[("bad", *args)]
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"error: {flag}" in lines[0], proc.stderr


def test_flops_per_token_matches_torch_flop_counter(lab02):
    """6N + 12 L d s, against torch's FlopCounterMode over one forward and backward. The
    counter sees the model's matmuls (the 6N); it has no count for the CPU's fused attention
    kernel, so the attention term is counted on the same shapes written out as two matmuls."""
    cfg = lab02.parse_config([])
    model = lab02.build_model(cfg)
    model.init_weights(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    matmuls = counter.get_total_flops()
    head_dim = cfg.dim // cfg.num_heads
    q, k, v = (torch.randn(2, cfg.num_heads, cfg.seq_len, head_dim, requires_grad=True)
               for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        (torch.softmax(q @ k.transpose(-2, -1), -1) @ v).sum().backward()
    attention = counter.get_total_flops() * cfg.num_layers
    assert matmuls + attention == kit_model.flops_per_token(cfg, cfg.seq_len) * tokens.numel()


def test_mfu_is_measured_against_a_labelled_peak(lab02):
    peak, source = metrics.device_peak_flops(torch.device("cpu"), None)
    assert peak > 1e8 and source.startswith("measured here: fp32 512x512 matmul")
    key, spec = plan.gpu_spec_for("NVIDIA H100 80GB HBM3")
    assert key == "H100-80GB" and spec["peak_flops"] == 989e12
    assert plan.gpu_spec_for("NVIDIA H100 PCIe")[0] == "H100-PCIe-80GB"
    assert plan.gpu_spec_for("Tesla V100-SXM2-32GB")[1]["bf16"] is False
    assert plan.gpu_spec_for("Some Future GPU") == (None, None)  # no guess


# What torch.cuda.get_device_name() returns on each GPU in GPU_SPECS (NVIDIA's product names as
# the driver reports them), and names that share a substring with an entry but are another GPU.
DEVICE_NAMES = {
    "NVIDIA B200": "B200-180GB", "NVIDIA H200": "H200-141GB", "NVIDIA H100 NVL": "H100-NVL-94GB",
    "NVIDIA H100 PCIe": "H100-PCIe-80GB", "NVIDIA H100 80GB HBM3": "H100-80GB",
    "NVIDIA A100-SXM4-80GB": "A100-80GB", "NVIDIA A100 80GB PCIe": "A100-80GB",
    "NVIDIA A100-SXM4-40GB": "A100-40GB", "NVIDIA A100-PCIE-40GB": "A100-40GB",
    "NVIDIA L40S": "L40S-48GB", "NVIDIA L4": "L4-24GB", "Tesla V100-SXM2-32GB": "V100-32GB",
    "Tesla T4": "T4-16GB",
}
NEAR_MISSES = ["NVIDIA L40", "NVIDIA GH200 480GB", "NVIDIA H200 NVL", "Tesla V100-SXM2-16GB",
               "NVIDIA A10", "NVIDIA A40", "NVIDIA RTX A4000", "NVIDIA GeForce RTX 4090"]


@pytest.mark.parametrize("name, key", DEVICE_NAMES.items())
def test_every_gpu_entry_matches_its_device_name(name, key):
    assert plan.gpu_spec_for(name)[0] == key


def test_every_gpu_entry_has_a_device_name_in_the_test():
    assert set(DEVICE_NAMES.values()) == set(plan.GPU_SPECS)


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_a_near_miss_name_gets_no_entry(name):
    """Errata: "NVIDIA L40" matched L4-24GB (121 TFLOP/s for MFU) and "GH200" matched the H200;
    a GPU not in the table gets no peak rather than a neighbour's."""
    assert plan.gpu_spec_for(name) == (None, None)
