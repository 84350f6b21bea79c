"""Kill a rank and lose nothing: restarts under torchrun, crashes mid-checkpoint, preemption.

Every scenario ends with the same parameters, bit for bit, as an uninterrupted run.
"""

import signal

import pytest
import torch

from launcher import LABS, PYTHON, free_port, preempt_lab, run, run_lab

LAB = "lab01_ddp"
ARGS = ["--steps", "12", "--grad-accum", "2", "--num-samples", "64"]  # crosses epochs
PREEMPTED_EXIT_CODE = 75


def final_model(checkpoint_dir):
    path = sorted(checkpoint_dir.glob("step_*.pt"))[-1]
    state = torch.load(path, weights_only=True)
    return state["step"], state["model"]


def assert_same_model(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    run_lab(LAB, 2, [*ARGS, "--checkpoint-dir", directory])
    return final_model(directory)


def elastic_cmd(*lab_args, max_restarts=1):
    return [PYTHON, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--rdzv-id", "fault-test", "--max-restarts", str(max_restarts),
            str(LABS / f"{LAB}.py"), *map(str, lab_args)]


@pytest.mark.parametrize("trial", range(4))
def test_rank_death_restart_resumes_bit_identical(trial, tmp_path, uninterrupted):
    """Rank 1 dies at step 5; torchrun restarts both ranks (the default shared-store mode,
    no environment workaround); they resume from step 4 and finish identical."""
    proc = run(elastic_cmd(*ARGS, "--checkpoint-dir", tmp_path, "--checkpoint-every", "2",
                           "--fail-at-step", "5", "--fail-rank", "1"), timeout=240)
    assert "injected failure: rank 1 exits at step 5" in proc.stderr
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    assert "terminate called" not in proc.stderr  # clean shutdown, no abort at exit
    step, model = final_model(tmp_path)
    assert step == uninterrupted[0] == 12
    assert_same_model(model, uninterrupted[1])


def test_crash_mid_checkpoint_never_corrupts_the_last_good_one(tmp_path, uninterrupted):
    crashed = run_lab(LAB, 2, [*ARGS, "--checkpoint-dir", tmp_path, "--checkpoint-every", "4",
                               "--crash-in-checkpoint", "8"], check=False)[0]
    assert crashed.returncode != 0
    assert "injected crash while writing the checkpoint of step 8" in crashed.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["run.json", "step_00000004.pt", "step_00000008.pt.tmp"]  # half-written is not a .pt
    resumed, _ = run_lab(LAB, 2, [*ARGS, "--checkpoint-dir", tmp_path, "--checkpoint-every", "4"])
    assert "at step 4" in resumed.stdout
    step, model = final_model(tmp_path)
    assert step == 12
    assert_same_model(model, uninterrupted[1])


def test_sigterm_finishes_the_step_checkpoints_and_exits_75(tmp_path):
    long_args = ["--steps", "3000", "--log-every", "5", "--checkpoint-dir", tmp_path]
    returncode, out, err = preempt_lab(LAB, 2, long_args, "step   10", timeout=120)
    assert returncode != 0
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in err, err[-2000:]
    assert "preempted: checkpoint at step" in out
    (checkpoint,) = tmp_path.glob("step_*.pt")
    stopped_at = torch.load(checkpoint, weights_only=True)["step"]
    assert 10 <= stopped_at < 3000

    # Resume to a short horizon and compare with a straight run to the same step.
    straight = tmp_path / "straight"
    horizon = stopped_at + 3
    common = ["--steps", str(horizon)]
    run_lab(LAB, 2, [*common, "--checkpoint-dir", straight])
    resumed, _ = run_lab(LAB, 2, [*common, "--checkpoint-dir", tmp_path])
    assert f"at step {stopped_at}" in resumed.stdout
    assert_same_model(final_model(tmp_path)[1], final_model(straight)[1])


def test_sigterm_alone_is_a_no_op_until_the_step_ends():
    """The handler only raises a flag (no I/O in a signal handler)."""
    from labkit.loop import PreemptionWatch

    previous = signal.getsignal(signal.SIGTERM)
    try:
        watch = PreemptionWatch()
        signal.raise_signal(signal.SIGTERM)
        assert watch.requested is True
    finally:
        signal.signal(signal.SIGTERM, previous)


def restart_drill(*flags):
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "drill",
           "--max-restarts", "1", str(LABS.parent / "runbooks" / "drills" / "restart_stale_store.py"),
           *flags]
    return run(cmd, timeout=240, check=False)


def test_restart_drill_reproduces_the_stale_store_and_the_fix_removes_it():
    """runbooks/restart-hang.md, cause C: the documented symptom, then the documented fix.
    The drill forces the stale read with a rendezvous-side sync, yet some unfixed restarts
    still recover (here, 2 of 5 test runs needed a retry and one saw 3 recoveries in a row), so
    the symptom gets up to 8 tries."""
    for _ in range(8):
        broken = restart_drill()
        if broken.returncode != 0:
            break
    assert broken.returncode != 0, broken.stdout + broken.stderr[-3000:]
    assert "Gloo connectFullMesh failed with" in broken.stderr
    fixed = restart_drill("--fixed")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "attempt 1 rank 0: all_reduce ok (3)" in fixed.stdout
    assert "attempt 1 rank 1: all_reduce ok (3)" in fixed.stdout
