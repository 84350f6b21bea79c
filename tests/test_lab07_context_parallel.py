"""lab07 (context parallelism composed with FSDP2) under torchrun on gloo: parity with one
process at cp 2 (the docstring's run), at cp 4 with the contiguous split and grouped-query
attention, and across a resume
from dp 2 x cp 2 at 4 ranks to cp 2 at 2 ranks; bad layouts refused in one line.

Each launch costs seconds, so each fixture is one launch that turns on more than one feature
(accumulation, another layout, a resume at another world size), each covered by a parity check.
"""

import pytest

from launcher import refusal_lines, run_lab, shared_lab_run

LAB = "lab07_context_parallel"
STEPS = 12


@pytest.fixture(scope="module")
def cp4_contiguous(tmp_path_factory):
    # Grouped-query attention too: the ring repeats the key/value heads as SDPA's enable_gqa.
    return run_lab(LAB, 4, ["--steps", STEPS, "--cp", 4, "--layout", "contiguous",
                            "--grad-accum", 2, "--num-kv-heads", 2, "--check-parity"],
                   tmp_path_factory.mktemp("cp4"), timeout=300)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """dp 2 x cp 2 at 4 ranks stops at step 6 with a checkpoint; cp 2 at 2 ranks resumes it
    and must end where one process ends after all 12 steps."""
    tmp = tmp_path_factory.mktemp("resume")
    common = ["--steps", STEPS, "--checkpoint-dir", tmp / "ckpt"]
    first, _ = run_lab(LAB, 4, [*common, "--cp", 2, "--stop-at-step", 6], tmp, timeout=300)
    second = run_lab(LAB, 2, [*common, "--cp", 2, "--resume", "--check-parity"], tmp,
                     timeout=300)
    return first, second


def test_cp2_matches_one_process():
    proc, metrics = shared_lab_run(LAB, 2, ["--check-parity"])
    assert metrics["cp"] == 2 and metrics["cp_layout"] == "zigzag"
    assert metrics["mesh"] == {"dp": 1, "cp": 2}
    assert metrics["parity_max_abs_diff"] <= metrics["parity_tol"] == 1e-5
    losses = [loss for _, loss in metrics["losses"]]
    assert losses[-1] < 0.5 * losses[0], "the loss should visibly fall"


def test_cp4_contiguous_with_accumulation_and_gqa_matches_one_process(cp4_contiguous):
    _, metrics = cp4_contiguous
    assert metrics["mesh"] == {"dp": 1, "cp": 4} and metrics["cp_layout"] == "contiguous"
    assert metrics["parity_max_abs_diff"] <= 1e-5
    assert len(metrics["reference_losses"]) == STEPS


def test_a_resume_from_dp2_cp2_at_cp2_ends_where_one_process_does(resumed):
    first, (second, metrics) = resumed
    assert "mesh {'dp': 2, 'cp': 2}" in first.stdout
    assert "resumed from" in second.stdout and "at step 6" in second.stdout
    assert metrics["mesh"] == {"dp": 1, "cp": 2}
    # The reference trains all 12 steps in one process; the run did 6 at 4 ranks, 6 at 2.
    assert metrics["parity_max_abs_diff"] <= 1e-5


@pytest.mark.parametrize("args, world_size, flag", [
    (["--cp", "3"], 4, "--cp"),
    (["--seq-len", "30"], 2, "--seq-len"),  # zigzag at cp 2 cuts 4 chunks
    (["--seq-len", "30", "--cp", "4", "--layout", "contiguous"], 4, "--seq-len"),
    (["--check-parity", "--amp", "bf16"], 2, "--check-parity"),
    (["--cpu-offload"], 2, "--cpu-offload"),  # lab02's knob, not this lab's (unrecognized)
])
def test_a_bad_layout_is_one_clear_line_and_exit_2(args, world_size, flag):
    lines = refusal_lines(LAB, args, world_size)
    assert len(lines) == 1 and flag in lines[0], lines
