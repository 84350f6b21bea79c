"""lab01_ddp under torchrun on gloo: parity, exact resume, bad input, copyability."""

import subprocess

import pytest
import torch

from launcher import LABS, PYTHON, run_all, run_lab

LAB = "lab01_ddp"


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def parity_run(request, tmp_path_factory):
    """One launch per world size: train with gradient accumulation, then --check-parity."""
    tmp = tmp_path_factory.mktemp(f"ddp{request.param}")
    proc, metrics = run_lab(LAB, request.param, ["--check-parity", "--grad-accum", "2"], tmp)
    return request.param, proc, metrics


def test_parity_with_single_process(parity_run):
    world_size, _, metrics = parity_run
    assert metrics["world_size"] == world_size and metrics["backend"] == "gloo"
    assert metrics["parity_max_abs_diff"] <= 1e-5
    # The loss curves agree step by step, not just at the end.
    ddp = [loss for _, loss in metrics["losses"]]
    assert max(abs(a - b) for a, b in zip(ddp, metrics["reference_losses"])) < 1e-5
    assert len(ddp) == metrics["steps"] == 40


def test_training_actually_learns(parity_run):
    _, _, metrics = parity_run
    first, last = metrics["losses"][0][1], metrics["final_loss"]
    assert first > 3.5  # about ln(64) = 4.16 at random init
    assert last < first / 3


def test_log_lines_and_summary(parity_run):
    _, proc, metrics = parity_run
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in lines] == [10, 20, 30, 40]
    assert all(" tok/s | data " in line and line.endswith(" GiB") for line in lines)
    assert proc.stdout.strip().splitlines()[-1].startswith("done | lab01_ddp | gloo x")
    assert len(metrics["peak_mem_bytes_per_rank"]) == metrics["world_size"]
    assert all(b > 0 for b in metrics["peak_mem_bytes_per_rank"])
    assert metrics["tokens_per_s"] > 0


def test_parity_check_fails_loudly_when_results_differ(tmp_path):
    """The parity check can fail: a one-big-batch reference is not what DDP computes under
    Adam at this precision, and a tolerance of 0 must trip at 4 ranks."""
    proc, metrics = run_lab(LAB, 4, ["--check-parity", "--parity-tol", "0", "--steps", "5"],
                            tmp_path, check=False)
    assert proc.returncode != 0
    assert "parity check failed" in proc.stdout + proc.stderr
    assert metrics["parity_max_abs_diff"] > 0


def final_state(checkpoint_dir):
    path = sorted(checkpoint_dir.glob("step_*.pt"))[-1]
    return torch.load(path, weights_only=True)


def test_resume_is_bit_identical(tmp_path):
    args = ["--steps", "24", "--grad-accum", "2", "--num-samples", "96"]  # crosses an epoch
    run_lab(LAB, 2, [*args, "--checkpoint-dir", tmp_path / "straight"])
    run_lab(LAB, 2, [*args, "--checkpoint-dir", tmp_path / "split", "--stop-at-step", "9"])
    assert [p.name for p in (tmp_path / "split").glob("step_*.pt")] == ["step_00000009.pt"]
    proc, _ = run_lab(LAB, 2, [*args, "--checkpoint-dir", tmp_path / "split"])
    assert "resumed from" in proc.stdout and "at step 9" in proc.stdout
    straight, split = final_state(tmp_path / "straight"), final_state(tmp_path / "split")
    assert straight["step"] == split["step"] == 24
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, split["model"][name]), name


def test_no_torchrun_runs_as_world_of_one(tmp_path):
    proc, metrics = run_lab(LAB, 0, ["--steps", "3", "--check-parity"], tmp_path)
    assert metrics["world_size"] == 1 and metrics["parity_max_abs_diff"] == 0.0


BAD_INPUTS = [
    (["--batch-size", "10", "--grad-accum", "4"], "--batch-size"),
    (["--steps", "0"], "--steps"),
    (["--device", "tpu"], "--device"),
    (["--amp", "fp8"], "--amp"),
    (["--dim", "66", "--num-heads", "4"], "--dim"),
    (["--resume", "--checkpoint-dir", "/nonexistent-dir"], "--resume"),
    (["--stop-at-step", "5"], "--checkpoint-dir"),
    (["--bucket-cap-mb", "-1"], "--bucket-cap-mb"),
    (["--fail-rank", "3"], "--fail-rank"),
    (["--lr", "abc"], "--lr"),
    (["--lr", "nan"], "--lr"),  # passes every "> 0" test; AdamW would raise on every rank
    (["--clip", "inf"], "--clip"),
    (["--checkpoint-dir", "/proc/forbidden"], "--checkpoint-dir"),  # mkdir fails there, even as root
    (["--metrics-out", "/proc/forbidden/metrics.json"], "--metrics-out"),
    (["--steps", "3", "--profile-dir", "/tmp/never-written"], "--profile-dir"),
]


@pytest.fixture(scope="module")
def refusals():
    """{args: the finished process} for every BAD_INPUTS case, each its own plain process,
    side by side (launcher.run_all)."""
    commands = [[PYTHON, str(LABS / f"{LAB}.py"), *args] for args, _ in BAD_INPUTS]
    return dict(zip((tuple(args) for args, _ in BAD_INPUTS), run_all(commands, timeout=60)))


@pytest.mark.parametrize("args,flag", BAD_INPUTS, ids=[b[1] + ":" + b[0][-1] for b in BAD_INPUTS])
def test_bad_input_is_one_clear_line(args, flag, refusals):
    proc = refusals[tuple(args)]
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], proc.stderr
    assert proc.stdout == ""


def test_a_resume_too_short_to_profile_is_refused(tmp_path):
    """--profile-dir counts the steps this launch runs: a resume from step 8 of 10 runs two,
    too few to record steps 3-4, and says so before any process group starts."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step_00000008.pt").touch()  # complete_checkpoints() only reads names
    proc = run_all([[PYTHON, str(LABS / f"{LAB}.py"), "--steps", "10", "--resume",
                     "--checkpoint-dir", tmp_path / "ckpt", "--profile-dir", tmp_path / "trace"]],
                   timeout=60)[0]
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "lab01_ddp.py: error: --profile-dir: needs 4 steps or more in this launch (it records "
        "steps 3-4 of them, after warm-up); this one runs 2"], proc.stderr


def test_cuda_request_without_gpu_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the refusal path is for CPU-only machines")
    proc = subprocess.run([PYTHON, str(LABS / f"{LAB}.py"), "--device", "cuda"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--device: cuda needs one GPU per local rank" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL path)")
def test_nccl_parity_on_gpus(tmp_path):
    _, metrics = run_lab(LAB, 2, ["--check-parity", "--amp", "off"], tmp_path)
    assert metrics["backend"] == "nccl" and metrics["parity_max_abs_diff"] <= 1e-5
