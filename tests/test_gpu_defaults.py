"""The labs' CUDA choices, tested on CPU: the decision logic driven by faked device
capabilities, and the loop's promise that it reads device values only at sync points.

What the choices are (labs/labkit/runtime.py, loop.py and checkpoint.py):
- precision: bf16 on a GPU that has it, fp16 + GradScaler on one that does not, fp32 on CPU;
- FSDP gathers in that dtype (MixedPrecisionPolicy), not fp32 under autocast;
- batches copied with non_blocking come from a pinned DataLoader on CUDA;
- losses and the preemption flag are reduced and read only at sync points, and step times are
  taken after that read (when the device has finished the window's work);
- a checkpoint keeps every random generator a rank draws from: the CPU's and, on CUDA, the
  device's.
"""

import argparse
import re
import signal

import pytest
import torch

import labkit.checkpoint
import labkit.data
import labkit.loop
import labkit.runtime
from launcher import LABS, load_script

LAB_PATHS = sorted(LABS.glob("lab[0-9][0-9]_*.py"))


@pytest.fixture(scope="module")
def labs():
    return {path.stem: load_script(path) for path in LAB_PATHS}


@pytest.mark.parametrize("requested, device_type, has_bf16, expected", [
    ("auto", "cpu", True, None),            # CPU: fp32, so parity holds to 1e-5
    ("auto", "cuda", True, torch.bfloat16),  # A100, H100: bf16, no loss scaling
    ("auto", "cuda", False, torch.float16),  # V100, T4: fp16 with a GradScaler
    ("off", "cuda", True, None),
    ("bf16", "cpu", True, torch.bfloat16),
    ("fp16", "cuda", True, torch.float16),
])
def test_precision_follows_the_device(labs, requested, device_type, has_bf16, expected):
    choosers = {labkit.runtime.choose_precision}
    choosers |= {lab.choose_precision for lab in labs.values() if hasattr(lab, "choose_precision")}
    for choose_precision in choosers:
        assert choose_precision(requested, device_type, has_bf16) is expected


def test_a_gpu_without_bf16_gets_fp16_and_a_live_grad_scaler(labs, monkeypatch):
    kit = labkit.runtime
    monkeypatch.setattr(kit, "cuda_has_bf16", lambda: False)  # a V100, faked
    cfg = labs["lab01_ddp"].parse_config([])
    dtype = kit.compute_dtype(cfg, "cuda")
    assert dtype is torch.float16 and kit.precision_name(dtype) == "fp16 + GradScaler"
    assert kit.make_grad_scaler(dtype, torch.device("cpu")).is_enabled()
    assert not kit.make_grad_scaler(torch.bfloat16, torch.device("cpu")).is_enabled()
    assert not kit.make_grad_scaler(None, torch.device("cpu")).is_enabled()


def test_fsdp_gathers_in_the_compute_dtype_by_default_on_cuda(labs, monkeypatch):
    """Autocast over fp32 shards would still all-gather fp32: twice the bytes of bf16."""
    lab = labs["lab02_fsdp"]
    cfg = lab.parse_config([])
    assert cfg.mixed_precision == "auto"
    monkeypatch.setattr(labkit.runtime, "cuda_has_bf16", lambda: True)  # an H100, faked
    assert lab.fsdp_param_dtype(cfg, "cuda") is torch.bfloat16
    monkeypatch.setattr(labkit.runtime, "cuda_has_bf16", lambda: False)  # a V100
    assert lab.fsdp_param_dtype(cfg, "cuda") is torch.float16
    assert lab.fsdp_param_dtype(cfg, "cpu") is None  # fp32 on CPU: parity unchanged
    assert lab.fsdp_param_dtype(lab.parse_config(["--mixed-precision", "fp32"]), "cuda") is None


def test_the_pipeline_timeline_probe_is_off_on_cuda():
    """Timing each action synchronises the GPU around it; the CPU runs synchronously anyway.
    The probe is the kit's (labkit/timeline.py), which the pipeline labs attach."""
    from labkit.timeline import timeline_enabled

    cfg = argparse.Namespace(timeline="auto")
    assert timeline_enabled(cfg, torch.device("cpu"))
    assert not timeline_enabled(cfg, argparse.Namespace(type="cuda"))
    assert timeline_enabled(argparse.Namespace(timeline="on"), argparse.Namespace(type="cuda"))


@pytest.mark.parametrize("lab_path", LAB_PATHS, ids=lambda p: p.stem)
def test_batches_are_pinned_on_cuda(lab_path, labs, monkeypatch):
    """non_blocking from pageable memory is a synchronous copy; from pinned memory it overlaps."""
    source = lab_path.read_text()
    train = source[source.index("\ndef train("):]
    assert re.search(r"micro_batches\((?:[^()]|\([^()]*\))*pin_memory=device\.type == \"cuda\"\)",
                     train), \
        "train() must ask for pinned batches on CUDA"
    lab = labs[lab_path.stem]
    loader_home = lab if hasattr(lab, "DataLoader") else labkit.data  # a lab on the kit
    seen = {}

    class Recording(loader_home.DataLoader):
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            super().__init__(*args, **{**kwargs, "pin_memory": False})  # no CUDA here

    monkeypatch.setattr(loader_home, "DataLoader", Recording)
    monkeypatch.setenv("WORLD_SIZE", "2")  # the pipeline lab needs two stages
    next(lab.micro_batches(lab.parse_config([]), 0, 1, 0, pin_memory=True))
    assert seen["pin_memory"] is True


class FakeWatch:
    requested = False


def step_log(monkeypatch, log_every=5, checkpoint_every=0, last_step=12):
    """The kit's StepLog (labs/labkit/loop.py), with the all-reduce it reads through counted."""
    reads = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda tensor, *a, **k: reads.append(len(tensor)))
    cfg = argparse.Namespace(log_every=log_every, checkpoint_every=checkpoint_every,
                             checkpoint_dir="ckpt" if checkpoint_every else "")
    return labkit.loop.StepLog(cfg, torch.device("cpu"), 0, last_step, loss_divisor=2), reads


def test_losses_are_read_only_at_sync_points(monkeypatch):
    log, reads = step_log(monkeypatch)
    watch = FakeWatch()
    for step in range(1, 13):
        assert log.add(step, torch.tensor(2.0 * step), 0.0, watch) is False
    # Sync points: the first step, every 5th, the last: one all-reduce (and one host read)
    # each, carrying the window's losses plus the preemption flag.
    assert reads == [1 + 1, 4 + 1, 5 + 1, 2 + 1]
    assert log.losses == [[step, float(step)] for step in range(1, 13)]  # summed / divisor
    assert [w["steps"] for w in log.windows] == [1, 4, 5, 2]


def test_checkpoint_steps_are_sync_points_and_carry_the_preemption_flag(monkeypatch):
    log, reads = step_log(monkeypatch, log_every=10, checkpoint_every=3, last_step=7)
    watch = FakeWatch()
    assert [log.is_sync_point(s) for s in range(1, 8)] == [True, False, True, False, False,
                                                            True, True]
    assert log.add(1, torch.tensor(1.0), 0.0, watch) is False
    watch.requested = True  # SIGTERM arrives during step 2
    assert log.add(2, torch.tensor(1.0), 0.0, watch) is False  # not a sync point: no read
    assert log.add(3, torch.tensor(1.0), 0.0, watch) is True  # agreed at the next one
    assert len(reads) == 2


def test_sigterm_only_raises_the_flag(labs):
    previous = signal.getsignal(signal.SIGTERM)
    try:
        watch = labkit.loop.PreemptionWatch()
        signal.raise_signal(signal.SIGTERM)
        assert watch.requested is True
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("lab_path", LAB_PATHS, ids=lambda p: p.stem)
def test_the_training_step_reads_nothing_from_the_device(lab_path):
    """No .item(), .tolist() or synchronize between sync points: the step functions return
    device tensors, and only StepLog.add reads them."""
    source = lab_path.read_text()
    if "\ndef train_step(" not in source:  # a lab on the kit takes the kit's step
        source = (LABS / "labkit" / "loop.py").read_text()
    step = re.search(r"\ndef train_step\(.*?(?=\n\S)", source, re.S).group(0)
    assert not re.search(r"\.item\(\)|\.tolist\(\)|synchronize\(", step), lab_path.stem
    assert "seconds_since" not in source  # the old per-step synchronize


def test_the_rng_state_round_trips_on_cpu_and_keeps_the_device_generator_on_cuda(monkeypatch):
    """torch.get_rng_state() is the CPU generator only: on CUDA, dropout and sampling draw
    from the device's, which a resume must restore too. CPU: a real round trip. CUDA: faked
    (no GPU here), checking that the device's state is saved and handed back to it."""
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    saved = labkit.checkpoint.rng_state(cpu)
    first = torch.rand(4)
    labkit.checkpoint.restore_rng_state(saved, cpu)
    assert set(saved) == {"cpu"} and torch.equal(torch.rand(4), first)

    device_states, restored = {0: torch.tensor([7, 8, 9], dtype=torch.uint8)}, {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: device_states[device.index])
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device: restored.update({device.index: state}))
    cuda = torch.device("cuda", 0)
    saved = labkit.checkpoint.rng_state(cuda)
    assert set(saved) == {"cpu", "cuda"} and torch.equal(saved["cuda"], device_states[0])
    labkit.checkpoint.restore_rng_state(saved, cuda)
    assert torch.equal(restored[0], device_states[0])
    labkit.checkpoint.restore_rng_state({"cpu": saved["cpu"]}, cuda)  # saved on CPU: no error
