"""labs/memory_estimator.py: the ZeRO memory table, checked against arithmetic done by hand.

The comparison with what ranks really hold is in test_lab02_fsdp.py (it needs launches); this
file is pure Python and runs in well under a second.
"""

import importlib.util
import math

import pytest

from launcher import LABS, PYTHON, run

spec = importlib.util.spec_from_file_location("memory_estimator", LABS / "memory_estimator.py")
est = importlib.util.module_from_spec(spec)
spec.loader.exec_module(est)

P70B, GB = 70e9, 1e9


@pytest.mark.parametrize("strategy, params_gb, grads_gb, optimizer_gb, total_gb", [
    ("ddp", 280, 280, 560, 1120),        # 16 B/param everywhere: the "1120 GB" of the article
    ("zero1", 280, 280, 8.75, 568.75),   # only AdamW's two fp32 states are split 64 ways
    ("zero2", 280, 4.375, 8.75, 293.125),
    ("zero3", 4.375, 4.375, 8.75, 17.5),  # 1120 / 64 = 17.5 GB, not the article's 17.6
])
def test_70b_adam_64_ranks(strategy, params_gb, grads_gb, optimizer_gb, total_gb):
    e = est.estimate_per_rank(P70B, 64, strategy)
    assert (e.params_bytes / GB, e.grads_bytes / GB, e.optimizer_bytes / GB) == pytest.approx(
        (params_gb, grads_gb, optimizer_gb))
    assert e.total_bytes / GB == pytest.approx(total_gb)
    assert e.total_bytes == e.params_bytes + e.grads_bytes + e.optimizer_bytes


def test_fsdp_is_an_alias_of_zero3_and_bad_names_are_rejected():
    assert est.estimate_per_rank(1000, 8, "fsdp") == est.estimate_per_rank(1000, 8, "zero3")
    assert est.STRATEGIES == ("ddp", "zero1", "zero2", "zero3")
    with pytest.raises(ValueError, match="strategy"):
        est.estimate_per_rank(1000, 8, "zero4")
    with pytest.raises(ValueError, match="optimizer"):
        est.estimate_per_rank(1000, 8, "ddp", optimizer="lion")
    with pytest.raises(ValueError, match="world_size"):
        est.estimate_per_rank(1000, 0, "ddp")


def test_dtypes_optimizer_and_master_weights():
    # bf16 params and grads, fp32 Adam states plus an fp32 master copy: 2 + 2 + 8 + 4 = 16 B.
    e = est.estimate_per_rank(1000, 1, "ddp", param_bytes=2, grad_bytes=2, master_weights=True)
    assert (e.params_bytes, e.grads_bytes, e.optimizer_bytes) == (2000, 2000, 12000)
    assert est.estimate_per_rank(1000, 1, "ddp", optimizer="sgd").optimizer_bytes == 0
    assert est.estimate_per_rank(1000, 1, "ddp", optimizer="sgd-momentum").optimizer_bytes == 4000


def test_shapes_add_fsdp2_dim0_padding():
    # (5, 3) over 4 ranks: torch.chunk gives rows 2, 2, 1, 0; FSDP2 pads every shard to 2 rows.
    shapes = [(5, 3), (64,)]
    e = est.estimate_per_rank(None, 4, "zero3", shapes=shapes)
    per_rank_numel = 2 * 3 + 16
    assert e.params_bytes == per_rank_numel * 4
    assert e.optimizer_bytes == per_rank_numel * 8
    even = est.estimate_per_rank(15 + 64, 4, "zero3")
    assert even.params_bytes == math.ceil(79 / 4) * 4 < e.params_bytes  # padding costs bytes
    # Replicated strategies do not care about shapes.
    assert est.estimate_per_rank(None, 4, "ddp", shapes=shapes).params_bytes == 79 * 4
    with pytest.raises(ValueError, match="sum over shapes"):
        est.estimate_per_rank(80, 4, "zero3", shapes=shapes)


def test_left_out_names_what_the_table_does_not_count():
    text = " ".join(est.LEFT_OUT).lower()
    for thing in ("activations", "unsharded", "prefetch", "communication buffers",
                  "fragmentation", "cuda context"):
        assert thing in text, thing


def test_cli_prints_every_strategy_and_rejects_bad_input():
    out = run([PYTHON, str(LABS / "memory_estimator.py"), "--params", "70e9",
               "--world-size", "64"], timeout=60).stdout
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.split() and line.split()[0] in est.STRATEGIES}
    assert set(rows) == set(est.STRATEGIES)
    assert "1120.00 GB" in rows["ddp"] and "17.50 GB" in rows["zero3"]
    assert "activations" in out
    bad = run([PYTHON, str(LABS / "memory_estimator.py"), "--params", "70e9",
               "--world-size", "0"], timeout=60, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--world-size" in bad.stderr
