"""lab05: pipeline x FSDP x tensor parallel on one ("pp", "dp", "tp") mesh.

Parity with one process at 8 gloo ranks on three layouts (and a fourth schedule), every
parameter, the step-1 gradients and every loss within 1e-5; the per-rank layout lines; a DCP
checkpoint resharded across three layouts (2 x 2 x 2, then 1 x 2 x 4, then one process)
whose losses continue the uninterrupted run's; bad layouts refused before any process group.
"""

import json
import os
import re
import subprocess

import pytest

from launcher import LABS, PYTHON, REPO, load_script, run_lab, shared_lab_run

TOL = 1e-5
LAB = "lab05_3d"


@pytest.fixture(scope="module")
def default_run():
    """The default layout, pp 2 x dp 2 x tp 2, with parity: the docstring's run, which
    test_lab_contracts also checks (one launch for both)."""
    return shared_lab_run(LAB, 8, ["--check-parity"])


def assert_parity(metrics):
    assert metrics["parity_max_abs_diff"] <= TOL, metrics["parity_max_abs_diff"]
    assert metrics["grad_parity_max_abs_diff"] <= TOL, metrics["grad_parity_max_abs_diff"]
    assert metrics["loss_parity_max_abs_diff"] <= TOL, metrics["loss_parity_max_abs_diff"]
    assert len(metrics["reference_losses"]) == metrics["steps"]


def test_the_automatic_layout():
    lab = load_script(LABS / f"{LAB}.py")
    assert [lab.auto_layout(n) for n in (1, 2, 3, 4, 8, 16)] == [
        (1, 1, 1), (1, 1, 2), (1, 3, 1), (2, 1, 2), (2, 2, 2), (2, 4, 2)]


def test_2x2x2_matches_one_process(default_run):
    proc, metrics = default_run
    assert (metrics["pp_size"], metrics["dp_size"], metrics["tp_size"]) == (2, 2, 2)
    assert metrics["world_size"] == 8 and metrics["steps"] == 20
    assert_parity(metrics)
    assert metrics["losses"][-1][1] < metrics["losses"][0][1] - 2  # it learns


def test_every_rank_says_where_it_sits_and_what_it_holds(default_run):
    proc, _ = default_run
    lines = re.findall(r"^rank (\d) \| pp (\d) dp (\d) tp (\d) \| (.*)$", proc.stdout, re.M)
    assert sorted(int(r) for r, *_ in lines) == list(range(8))
    for rank, pp, dp, tp, held in lines:
        # Rank r sits at arange(8).view(2, 2, 2)[pp, dp, tp]: tp innermost.
        assert int(rank) == 4 * int(pp) + 2 * int(dp) + int(tp)
        if pp == "0":
            assert "stage 0 (layers 0,1 + tok_embeddings)" in held, held
        else:
            assert "stage 1 (layers 2,3 + output)" in held, held
        # wq (64, 64): heads split over tp (64 -> 32 rows), then FSDP over dp (32 -> 16).
        assert "wq (64, 64) held as (16, 64)" in held, held


def test_interleaved_on_4x1x2_with_clipping_and_recompute_matches_one_process(tmp_path):
    """8 stages on 4 pp ranks (Interleaved1F1B), TP pairs, no FSDP. A tight --clip makes
    clipping act every step, so a gradient norm that counted the norms' tp copies twice would
    break parity. With --activation-checkpointing: recomputing each block in backward, inside
    TP and the pipeline, must give the same gradients."""
    _, metrics = run_lab(LAB, 8, ["--pp", "4", "--dp", "1", "--tp", "2", "--schedule",
                                  "Interleaved1F1B", "--clip", "0.05", "--check-parity",
                                  "--activation-checkpointing", "--steps", "6"], tmp_path,
                         timeout=300)
    assert metrics["config"]["activation_checkpointing"] is True
    assert (metrics["pp_size"], metrics["stages_per_rank"]) == (4, 2)
    assert_parity(metrics)


# One checkpoint resumed on three layouts (2 x 2 x 2, then 1 x 2 x 4, then one process), each
# leg with its own parity check and the chained losses equal to an uninterrupted run's: that
# runs, with its asserts, in lessons/05_3d.py ("Parity on three layouts, and one checkpoint
# resumed on three layouts"), which the suite executes. It is not run a second time here.


def plain(args, world_size):
    """The lab as one of `world_size` ranks, as torchrun would start it: its checks run, and
    it must exit before it starts any process group."""
    env = {**os.environ, "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
    return subprocess.run([PYTHON, str(LABS / f"{LAB}.py"), *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=env)


@pytest.mark.parametrize("args, world_size, flag, says", [
    (["--pp", "2", "--dp", "2", "--tp", "2"], 4, "--pp/--dp/--tp",
     "2 x 2 x 2 = 8 ranks, but the world size is 4"),
    (["--pp", "2", "--dp", "2", "--tp", "1"], 8, "--pp/--dp/--tp", "= 4 ranks"),
    (["--pp", "0", "--dp", "2", "--tp", "2"], 8, "--pp", "must be > 0"),
    (["--tp", "2"], 8, "--pp", "give all three"),
    (["--pp", "1", "--dp", "1", "--tp", "8"], 8, "--num-heads", "4 must divide by --tp 8"),
    (["--pp", "2", "--dp", "2", "--tp", "2", "--vocab-size", "65"], 8, "--vocab-size",
     "65 must divide by --tp 2"),
    (["--schedule", "Interleaved1F1B", "--microbatches", "5", "--batch-size", "40"], 8,
     "--microbatches", "and 5 does not divide by 2"),
    (["--num-layers", "3"], 8, "--num-layers", "must split evenly"),
])
def test_a_bad_layout_is_one_line_and_exit_2(args, world_size, flag, says):
    proc = plain(args, world_size)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"error: {flag}" in lines[0] and says in lines[0], proc.stderr


def test_a_70b_plan_divides_the_state_by_dp_x_tp_and_starts_nothing():
    """70.55B parameters over pp 4 x dp 2 x tp 8: the first stage's 20 blocks, embedding and
    output (the busiest rank), sharded 16 ways over dp x tp."""
    proc = plain(["--plan", "--model", "70b", "--nproc", "64", "--gpu", "H100-80GB",
                  "--pp", "4", "--dp", "2", "--tp", "8", "--microbatches", "8"], 1)
    assert proc.returncode == 0, proc.stderr
    assert "plan | lab05_3d | 64 x H100-80GB | --model 70b: 70.55B params" in proc.stdout
    assert "pp=4, dp=2, tp=8" in proc.stdout
    block = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    held = 20 * block + 2 * 128256 * 8192 + 8192
    shown = float(re.search(r"params \(fp32\)\s+([\d.]+) GB", proc.stdout).group(1))
    assert abs(shown - 4 * held / 16 / 1e9) < 0.005, (shown, 4 * held / 16 / 1e9)
    # Under pipelining FSDP keeps the whole stage gathered (bf16) with fp32 gradients, 1/tp each.
    gathered = float(re.search(r"gathered \(FSDP\)\s+([\d.]+) GB", proc.stdout)[1])
    assert "(gathered (FSDP): the root and the whole stage, with gradients)" in proc.stdout
    assert abs(gathered - held * (2 + 4) / 8 / 1e9) < 0.005, gathered
    assert "does NOT fit" in proc.stdout and "with --activation-checkpointing:" in proc.stdout
