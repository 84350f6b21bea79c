"""`make gpu-check` (tools/gpu_check.py): its refusal without a GPU, its plan, its stamps.

CPU tier: the no-GPU line and exit 1; the planned commands name every lab, with parity runs
in fp32, and every flag they pass exists in that lab and passes its own validation at 1 and 8
GPUs; a command past its timeout is FAILED, naming it; pytest's counts are read honestly;
gpu_stamp() from a temporary record. GPU tier: lab03 and lab04 on NCCL at world size 2, marked
gpu like the rest of that tier and skipped with the reason on fewer than 2 GPUs.
"""

import contextlib
import io
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from launcher import LABS, PYTHON, REPO, help_texts, load_script, quiet_env, run_lab

import gpu_check  # tools/gpu_check.py (the root conftest.py puts tools/ on sys.path)
import verified

SIZES = (1, 8)


def lab_argv(cmd):
    """The lab's own arguments: what follows the script path in a torchrun command."""
    script = next(i for i, part in enumerate(cmd) if part.endswith(".py"))
    return cmd[script + 1:]


def without_metrics_out(argv):
    at = argv.index("--metrics-out")
    return argv[:at] + argv[at + 2:]


def every_run(num_gpus, tmp_path):
    runs = gpu_check.planned_runs(num_gpus, tmp_path)
    return runs + [gpu_check.fill_run(num_gpus, m, tmp_path) for m in gpu_check.FILL_MODELS]


@pytest.fixture(scope="module")
def lab_flags():
    """{lab: the set of flags its --help lists}, every lab's --help from one interpreter."""
    texts = help_texts([(LABS / f"{lab}.py",) for lab in gpu_check.LABS])
    return {lab: set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", texts[str(LABS / f"{lab}.py")]))
            for lab in gpu_check.LABS}


def test_without_a_gpu_one_line_and_exit_1():
    before = verified.GPU_RECORDS.read_bytes() if verified.GPU_RECORDS.exists() else None
    proc = subprocess.run([PYTHON, str(REPO / "tools" / "gpu_check.py")], capture_output=True,
                          text=True, timeout=120, env=quiet_env({"CUDA_VISIBLE_DEVICES": ""}))
    assert proc.returncode == 1
    assert proc.stdout == "" and proc.stderr.splitlines() == [gpu_check.NO_GPU], proc.stderr
    after = verified.GPU_RECORDS.read_bytes() if verified.GPU_RECORDS.exists() else None
    assert after == before  # nothing ran, so nothing is recorded


@pytest.mark.parametrize("num_gpus", SIZES)
def test_plan_names_every_lab_with_defaults_and_fp32_parity(num_gpus, tmp_path):
    runs = gpu_check.planned_runs(num_gpus, tmp_path)
    assert {r["lab"] for r in runs} == set(gpu_check.LABS)
    for r in runs:
        if r["skip"]:
            continue
        argv = lab_argv(r["cmd"])
        assert r["cmd"][r["cmd"].index("--nproc-per-node") + 1] == str(num_gpus)
        assert "--standalone" in r["cmd"] and "--device" in argv and "cuda" in argv
        assert "--metrics-out" in argv and "--steps" in argv
        if r["what"] == "parity":
            assert "--check-parity" in argv and argv[argv.index("--amp") + 1] == "off"
        else:
            assert "--amp" not in argv and "--check-parity" not in argv  # the GPU defaults
    parity = [r for r in runs if r["what"] == "parity" and not r["skip"]]
    lab02 = next(lab_argv(r["cmd"]) for r in parity if r["lab"] == "lab02_fsdp")
    assert lab02[lab02.index("--mixed-precision") + 1] == "fp32"
    assert {r["lab"] for r in parity} == set(gpu_check.LABS) - ({"lab04_pipeline"}
                                                                if num_gpus == 1 else set())


def test_the_pipeline_lab_is_a_stated_skip_on_one_gpu(tmp_path):
    pipeline = [r for r in gpu_check.planned_runs(1, tmp_path) if r["lab"] == "lab04_pipeline"]
    assert {r["what"] for r in pipeline} == {"defaults", "parity"}
    for r in pipeline:
        assert r["cmd"] is None and r["skip"] == "the pipeline lab needs >= 2 GPUs"
        result = gpu_check.check_lab(r, gpu_check.Deadline(60))
        assert result["status"] == "skipped" and result["reason"] == r["skip"]


@pytest.mark.parametrize("num_gpus", SIZES)
def test_every_flag_exists_in_the_labs_help(num_gpus, tmp_path, lab_flags):
    for r in every_run(num_gpus, tmp_path):
        if r["skip"]:
            continue
        used = {part for part in lab_argv(r["cmd"]) if part.startswith("--")}
        assert used <= lab_flags[r["lab"]], (r["lab"], r["what"], used - lab_flags[r["lab"]])
    plan = set(p for p in gpu_check.plan_command(num_gpus, "1b") if p.startswith("--"))
    assert plan <= lab_flags["lab02_fsdp"]


@pytest.mark.parametrize("num_gpus", SIZES)
def test_every_planned_run_passes_the_labs_own_validation(num_gpus, tmp_path):
    """Each lab's parse_config, given the planned arguments and --plan for num_gpus ranks of
    an H100, accepts them (exit 0); a refused combination (too few microbatches for 8 stages,
    a --tp that does not divide) exits 2 before any GPU is needed."""
    labs = {lab: load_script(LABS / f"{lab}.py") for lab in gpu_check.LABS}
    for r in every_run(num_gpus, tmp_path):
        if r["skip"]:
            continue
        argv = [*without_metrics_out(lab_argv(r["cmd"])), "--plan", "--gpu", "H100-80GB",
                "--nproc", str(num_gpus)]
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            with pytest.raises(SystemExit) as exit_:
                labs[r["lab"]].parse_config(argv)
        assert exit_.value.code in (0, None), (r["lab"], r["what"], argv, err.getvalue())


def test_a_command_past_its_timeout_is_failed_and_named(tmp_path, monkeypatch):
    run = {"lab": "lab01_ddp", "what": "defaults", "model": "debug", "skip": None,
           "metrics": tmp_path / "never.json",
           "cmd": [PYTHON, "-c", "import time; time.sleep(60)"]}
    monkeypatch.setattr(gpu_check, "RUN_TIMEOUT_S", 1)
    result = gpu_check.check_lab(run, gpu_check.Deadline(gpu_check.MIN_START_S + 2))
    assert result["status"] == "failed"
    assert result["reason"].startswith("timed out after 1 s: ") and "time.sleep(60)" in result["reason"]


def alive(pid):
    """Running, not gone and not a zombie (a container's init may never reap one)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


WORKER_IN_ITS_OWN_SESSION = """import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                          start_new_session=True)  # as torchrun starts its workers
print(worker.pid, flush=True)
time.sleep(60)
"""


def test_a_timeout_kills_the_workers_torchrun_put_in_their_own_sessions():
    done = gpu_check.run_command([PYTHON, "-c", WORKER_IN_ITS_OWN_SESSION], timeout=3)
    assert done["rc"] is None
    worker = int(done["out"].split()[0])
    deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker)


def test_a_run_the_deadline_leaves_no_time_for_is_failed_not_passed(tmp_path):
    run = gpu_check.planned_runs(1, tmp_path)[0]
    result = gpu_check.check_lab(run, gpu_check.Deadline(0))
    assert result["status"] == "failed" and "deadline" in result["reason"]


@pytest.mark.parametrize("rc,out,status", [
    (0, "....s\n4 passed, 2 skipped, 900 deselected in 61.20s (0:01:01)", "passed"),
    (1, "F...\nFAILED tests/x.py::t\n1 failed, 3 passed, 900 deselected in 40.00s", "failed"),
    (0, "ss\n2 skipped, 900 deselected in 3.00s", "failed"),  # nothing ran: not a pass
    (5, "900 deselected in 3.00s", "failed"),
    (None, "....", "failed"),  # timed out
])
def test_pytest_verdict_is_read_honestly(rc, out, status):
    result = gpu_check.pytest_result({"rc": rc, "out": out, "wall_s": 1.0},
                                     gpu_check.pytest_command(), 300)
    assert result["status"] == status, result
    if rc == 1:
        assert result["counts"] == {"failed": 1, "passed": 3, "deselected": 900}


def entry(what, run="2026-12-01T10:00:00+00:00", **changes):
    base = {"lab": "lab02_fsdp", "what": what, "model": "debug", "device": "NVIDIA H100 80GB HBM3",
            "num_gpus": 8, "torch": "2.13.0", "cuda": "12.8", "nccl": "2.27.3",
            "precision": "bf16", "parity": None, "tokens_per_s": 5000.0, "mfu": 0.01,
            "status": "passed", "reason": None, "date": run[:10], "run": run,
            "command": "python -m torch.distributed.run ..."}
    return {**base, **changes}


def write_records(path, entries):
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def test_gpu_stamp_is_none_without_a_record(tmp_path):
    assert verified.gpu_stamp("lab02_fsdp", tmp_path / "missing.jsonl") is None
    records = write_records(tmp_path / "gpu.jsonl", [entry("defaults", lab="lab01_ddp")])
    assert verified.gpu_stamp("lab02_fsdp", records) is None


def test_gpu_stamp_from_the_newest_run(tmp_path):
    records = write_records(tmp_path / "gpu.jsonl", [
        entry("parity", run="2026-11-01T09:00:00+00:00", parity=9e-6, precision="fp32"),
        entry("defaults"),
        entry("parity", parity=1.23e-6, precision="fp32", tokens_per_s=4000.0),
        entry("fill", model="1b", tokens_per_s=123456.4, mfu=0.412),
    ])
    assert verified.gpu_stamp("lab02_fsdp", records) == (
        "GPU: verified on 2026-12-01 by make gpu-check on 8 x NVIDIA H100 80GB HBM3, "
        "torch 2.13.0, CUDA 12.8, NCCL 2.27.3: parity 1.2e-06 (fp32), 123456 tok/s at 41.2% "
        "MFU (bf16, --model 1b).")


def test_gpu_stamp_says_a_skip_and_never_calls_it_verified(tmp_path):
    reason = "the pipeline lab needs >= 2 GPUs"
    records = write_records(tmp_path / "gpu.jsonl", [
        entry(what, lab="lab04_pipeline", num_gpus=1, status="skipped", reason=reason,
              tokens_per_s=None, mfu=None, precision=None) for what in ("defaults", "parity")])
    stamp = verified.gpu_stamp("lab04_pipeline", records)
    assert stamp == ("GPU: not verified by make gpu-check on 2026-12-01 on 1 x NVIDIA H100 80GB "
                     "HBM3, torch 2.13.0, CUDA 12.8, NCCL 2.27.3: defaults and parity skipped: "
                     f"{reason}.")


# ---------------------------------------------------------------- GPU tier
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA GPUs (NCCL path, one GPU per rank)")


@pytest.mark.gpu
@needs_two_gpus
def test_lab03_nccl_parity_on_two_gpus(tmp_path):
    _, metrics = run_lab("lab03_tp_fsdp", 2, ["--device", "cuda", "--tp", "2", "--check-parity",
                                              "--amp", "off"], tmp_path, timeout=300)
    assert metrics["backend"] == "nccl" and metrics["world_size"] == 2
    assert metrics["parity_max_abs_diff"] <= 1e-5


@pytest.mark.gpu
@needs_two_gpus
def test_lab04_nccl_parity_on_two_gpus(tmp_path):
    _, metrics = run_lab("lab04_pipeline", 2, ["--device", "cuda", "--check-parity",
                                               "--amp", "off"], tmp_path, timeout=300)
    assert metrics["backend"] == "nccl" and metrics["world_size"] == 2
    assert metrics["parity_max_abs_diff"] <= 1e-5


def test_labs_flag_reruns_only_the_named_labs_and_refuses_an_unknown_one(capsys):
    assert gpu_check.parse_args(["--labs", "lab05_3d,lab04_pipeline"]).labs == [
        "lab05_3d", "lab04_pipeline"]
    assert gpu_check.parse_args([]).labs == []
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(["--labs", "lab99_nothing"])
    assert exit_info.value.code == 2 and "unknown lab99_nothing" in capsys.readouterr().err
