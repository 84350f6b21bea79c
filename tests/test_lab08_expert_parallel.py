"""lab08 (expert parallelism composed with FSDP2) under torchrun on gloo: parity with one
process at ep 2 (the docstring's run), at dp 2 x ep 2 with accumulation and a capacity cap that
drops tokens, and across a resume from ep 4 at 4 ranks to dp 2 (ep 1) at 2 ranks; bad layouts
refused in one line.

Each launch costs seconds, so each fixture is one launch that turns on more than one feature,
each covered by a parity check. Parity is checked three ways: every parameter (AdamW makes them
nearly blind to a gradient's scale), each step's gradient norm (which sees a wrong expert
gradient divide factor), and the routing counts per block and expert.
"""

import pytest

from launcher import refusal_lines, run_lab, shared_lab_run

LAB = "lab08_expert_parallel"
STEPS = 12
SEQ_LEN = 32  # the debug preset's


def assert_parity(metrics, same_routing=True):
    assert metrics["parity_max_abs_diff"] <= metrics["parity_tol"] == 1e-5
    assert metrics["grad_norm_max_rel_diff"] <= 1e-4
    if same_routing:  # the run trained every step the reference did
        assert metrics["expert_load"] == metrics["reference_expert_load"]


def routing_choices_per_block(metrics, steps):
    """Every token of every step picks top_k experts in each block, before any cap."""
    return steps * metrics["config"]["batch_size"] * SEQ_LEN * metrics["top_k"]


@pytest.fixture(scope="module")
def dp2_ep2(tmp_path_factory):
    return run_lab(LAB, 4, ["--steps", STEPS, "--ep", 2, "--grad-accum", 2,
                            "--capacity-factor", 1.0, "--check-parity"],
                   tmp_path_factory.mktemp("dp2ep2"), timeout=300)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """ep 4 at 4 ranks (two experts per rank) stops at step 6 with a checkpoint; dp 2 x ep 1 at
    2 ranks (every expert on every rank, no all-to-all) resumes it and must end where one
    process ends after all 12 steps."""
    tmp = tmp_path_factory.mktemp("resume")
    common = ["--steps", STEPS, "--checkpoint-dir", tmp / "ckpt"]
    first, _ = run_lab(LAB, 4, [*common, "--ep", 4, "--stop-at-step", 6], tmp, timeout=300)
    second = run_lab(LAB, 2, [*common, "--ep", 1, "--resume", "--check-parity"], tmp,
                     timeout=300)
    return first, second


def test_ep2_matches_one_process():
    proc, metrics = shared_lab_run(LAB, 2, ["--check-parity"])
    assert metrics["mesh"] == {"dp": 1, "ep": 2} and metrics["ep"] == 2
    assert_parity(metrics)
    assert metrics["tokens_dropped"] == 0  # no --capacity-factor: no cap
    assert len(metrics["expert_load"]) == 2 and len(metrics["expert_load"][0]) == 8
    for block in metrics["expert_load"]:
        assert sum(block) == routing_choices_per_block(metrics, 40)
    losses = [loss for _, loss in metrics["losses"]]
    assert losses[-1] < 0.5 * losses[0], "the loss should visibly fall"


def test_dp2_ep2_with_accumulation_and_dropping_matches_one_process(dp2_ep2):
    _, metrics = dp2_ep2
    assert metrics["mesh"] == {"dp": 2, "ep": 2}
    assert_parity(metrics)
    assert len(metrics["reference_losses"]) == STEPS
    assert metrics["tokens_dropped"] > 0, "a capacity factor of 1.0 should drop some tokens"
    for block in metrics["expert_load"]:
        assert sum(block) == routing_choices_per_block(metrics, STEPS)
    # Experts: whole experts split over ep (dim 0), their rows over dp (dim 1).
    placements, shape, local = metrics["layout"]["layers.0.feed_forward.experts.w1"]
    assert placements == "(Shard(dim=1), Shard(dim=0))"
    assert shape == [8, 256, 64] and local == [[4, 128, 64]] * 4  # on each of the 4 ranks
    placements, _, _ = metrics["layout"]["layers.0.feed_forward.router.weight"]
    assert placements == "(Shard(dim=0),)"


def test_a_resume_from_ep4_at_dp2_ends_where_one_process_does(resumed):
    first, (second, metrics) = resumed
    assert "mesh {'dp': 1, 'ep': 4}" in first.stdout
    assert "resumed from" in second.stdout and "at step 6" in second.stdout
    assert metrics["mesh"] == {"dp": 2, "ep": 1}
    # The reference trains all 12 steps in one process; the run did 6 at 4 ranks, 6 at 2.
    assert_parity(metrics, same_routing=False)
    assert len(metrics["grad_norms"]) == STEPS - 6


@pytest.mark.parametrize("args, world_size, flag", [
    (["--ep", "3"], 4, "--ep"),
    (["--num-experts", "6", "--ep", "4"], 4, "--num-experts"),
    (["--top-k", "9"], 2, "--top-k"),  # 8 experts
    (["--capacity-factor", "-1"], 2, "--capacity-factor"),
    (["--check-parity", "--amp", "bf16"], 2, "--check-parity"),
    (["--mixed-precision", "bf16"], 2, "--mixed-precision"),  # lab02's knob (unrecognized)
])
def test_a_bad_layout_is_one_clear_line_and_exit_2(args, world_size, flag):
    lines = refusal_lines(LAB, args, world_size)
    assert len(lines) == 1 and flag in lines[0], lines
