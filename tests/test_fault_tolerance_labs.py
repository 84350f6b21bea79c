"""Kill a rank, crash mid-checkpoint, preempt a job: the labs that checkpoint with DCP lose
nothing.

The same scenarios as test_fault_tolerance.py (lab01), for the labs that checkpoint with
torch.distributed.checkpoint. Their checkpoints are sharded directories, so the comparison
first consolidates each one offline (dcp_to_torch_save, no process group) and then demands
bit-identical tensors: parameters and optimizer state.

What these scenarios exercise is shared code, written once in the kit (labs/labkit/): the
training loop, the fault injection and the SIGTERM watch (loop.py, faults.py), and the
tmp-then-rename commit of a DCP checkpoint (checkpoint.py). So two labs stand for all: lab02
(one FSDP model's state dict) and lab04 (a pipeline's per-stage state dicts, merged, in
labkit/pipeline.py, which lab05 uses too).
What differs per lab, the state it saves and loads, is covered by each lab's own resume test:
tests/test_lab03_tp_fsdp.py (another mesh), test_lab04_pipeline.py, lesson 05 (lab05 on
three layouts), test_lab07_context_parallel.py and test_lab08_expert_parallel.py (another
world size).
"""


import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from launcher import LABS, PYTHON, free_port, preempt_lab, run, run_lab

LABS_WITH_DCP = ["lab02_fsdp", "lab04_pipeline"]  # for all six: see the module docstring
ARGS = ["--steps", "8"]
PREEMPTED_EXIT_CODE = 75


def consolidated(checkpoint_dir, tmp_path):
    """The newest complete checkpoint as one flat {name: tensor} dict, and its step."""
    newest = sorted(p for p in checkpoint_dir.glob("step_*") if p.suffix != ".tmp")[-1]
    target = tmp_path / f"{checkpoint_dir.name}-{newest.name}.pt"
    dcp_to_torch_save(newest, target)
    state = torch.load(target, weights_only=False)  # written just now by dcp_to_torch_save
    return int(newest.name.split("_")[1]), dict(flatten(state))


def flatten(state, prefix=""):
    for key, value in state.items():
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value


def assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    assert any("weight" in name for name in a)  # really holds the model
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module", params=LABS_WITH_DCP)
def uninterrupted(request, tmp_path_factory):
    lab = request.param
    directory = tmp_path_factory.mktemp(f"{lab}-straight")
    run_lab(lab, 2, [*ARGS, "--checkpoint-dir", directory, "--checkpoint-every", "2"],
            timeout=300)
    return lab, consolidated(directory, tmp_path_factory.mktemp("consolidated"))


def test_rank_death_restart_resumes_bit_identical(uninterrupted, tmp_path):
    """Rank 1 dies at step 5; torchrun (c10d, --max-restarts 1) restarts both ranks, which
    resume from the checkpoint of step 4 and finish with the uninterrupted run's state."""
    lab, (straight_step, straight_state) = uninterrupted
    checkpoints = tmp_path / "checkpoints"
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "--rdzv-id", f"{lab}-restart", "--max-restarts", "1", str(LABS / f"{lab}.py"),
           *ARGS, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2",
           "--fail-at-step", "5", "--fail-rank", "1"]
    proc = run(cmd, timeout=300)
    assert "injected failure: rank 1 exits at step 5" in proc.stderr
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout, proc.stdout
    assert "terminate called" not in proc.stderr  # clean shutdown, no abort at exit
    step, state = consolidated(checkpoints, tmp_path)
    assert step == straight_step == 8
    assert_bit_identical(state, straight_state)


def test_sigterm_checkpoints_exits_75_and_resumes_bit_identical(uninterrupted, tmp_path):
    lab, _ = uninterrupted
    checkpoints = tmp_path / "checkpoints"
    long_args = ["--steps", "3000", "--log-every", "2", "--checkpoint-dir", checkpoints]
    returncode, out, err = preempt_lab(lab, 2, long_args, "step    4")
    assert returncode != 0
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in err, err[-2000:]
    assert "preempted: checkpoint at step" in out, out
    stopped_at, _ = consolidated(checkpoints, tmp_path)
    assert 4 <= stopped_at < 3000

    horizon = ["--steps", str(stopped_at + 2)]
    straight = tmp_path / "straight"
    run_lab(lab, 2, [*horizon, "--checkpoint-dir", straight], timeout=300)
    resumed, _ = run_lab(lab, 2, [*horizon, "--checkpoint-dir", checkpoints], timeout=300)
    assert f"at step {stopped_at}" in resumed.stdout
    assert_bit_identical(consolidated(checkpoints, tmp_path)[1],
                         consolidated(straight, tmp_path)[1])


def test_crash_mid_checkpoint_resumes_from_the_previous_one(uninterrupted, tmp_path):
    """Rank 0 dies after DCP wrote every shard of step 6 but before the rename that commits it.
    The half-written step_00000006.tmp must never be loaded: the rerun resumes from step 4 and
    ends bit-identical to the uninterrupted run."""
    lab, (straight_step, straight_state) = uninterrupted
    checkpoints = tmp_path / "checkpoints"
    common = [*ARGS, "--checkpoint-dir", checkpoints, "--checkpoint-every", "2"]
    crashed, _ = run_lab(lab, 2, [*common, "--crash-in-checkpoint", "6"], timeout=300,
                         check=False)
    assert crashed.returncode != 0
    assert "injected crash while writing the checkpoint of step 6" in crashed.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "run.json", "step_00000002", "step_00000004", "step_00000006.tmp"]
    resumed, _ = run_lab(lab, 2, common, timeout=300)
    assert "at step 4" in resumed.stdout, resumed.stdout
    step, state = consolidated(checkpoints, tmp_path)
    assert step == straight_step == 8
    assert_bit_identical(state, straight_state)
