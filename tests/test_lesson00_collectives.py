"""Fast checks of lesson 00's worker functions (lessons/collective_workers.py).

The lesson itself runs under nbval at world size 4; these run the same functions at world
sizes 2, 3 and 4 (3: uneven ring chunks, odd ring) against expectations computed here, plus
the gloo fallbacks that torch < 2.8 takes. One spawn per world size.
"""

import sys

import pytest
import torch

from launcher import PYTHON, REPO, run

sys.path.insert(0, str(REPO / "lessons"))
import collective_workers as cw  # noqa: E402
from spawn import run_workers  # noqa: E402

RING_NUMEL = 1001  # divisible by none of 2, 3, 4: the ring's chunks are uneven


def everything(rank, world_size):
    """One spawn's worth of work: the lesson's workers, then the old-gloo fallbacks."""
    result = {"ring": cw.check_ring(rank, world_size, RING_NUMEL),
              "collectives": cw.run_collectives(rank, world_size),
              "patterns": cw.strategy_patterns(rank, world_size)}
    result["timing"] = cw.time_all_reduce(rank, world_size, [1024, 16 << 20], repeats=3)
    cw.GLOO_HAS_AVG_AND_REDUCE_SCATTER = False  # take the torch < 2.8 code paths
    x = cw.rank_values(rank, 4)
    cw.all_reduce_avg(x)
    mine = torch.empty(1)
    cw.reduce_scatter_list(mine, list(cw.rank_values(rank, world_size).chunk(world_size)))
    result["fallback"] = {"avg": x, "reduce_scatter": mine}
    return result


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def world(request):
    n = request.param
    return n, run_workers(everything, n, timeout_s=120)


def test_ring_matches_all_reduce_and_sends_2_n_minus_1_over_n(world):
    n, results = world
    chunk_bytes = [c.numel() * 4 for c in torch.empty(RING_NUMEL).tensor_split(n)]
    total = RING_NUMEL * 4
    for rank, res in enumerate(results):
        ring = res["ring"]
        assert ring["ints_equal"], f"rank {rank}: integer ring sum differs from all_reduce"
        assert ring["max_abs_diff"] <= 1e-5, ring["max_abs_diff"]
        # Phase 1 sends every chunk but (r+1), phase 2 every chunk but (r+2).
        expected = 2 * total - chunk_bytes[(rank + 1) % n] - chunk_bytes[(rank + 2) % n]
        assert ring["bytes_sent"] == expected
        assert len(ring["trace"]) == 1 + 2 * (n - 1)
        everyone = float("1" * n)  # 10**0 + ... + 10**(n-1)
        assert torch.equal(ring["trace"][-1], torch.full((n,), everyone, dtype=torch.float64))
        # After reduce-scatter, rank r owns the finished chunk r+1 (and only that one).
        after_phase1 = ring["trace"][n - 1]
        assert after_phase1[(rank + 1) % n] == everyone
        assert (after_phase1 == everyone).sum() == 1
    mean_sent = sum(r["ring"]["bytes_sent"] for r in results) / n
    assert mean_sent == pytest.approx(2 * (n - 1) / n * total)


def test_each_collective_gives_what_the_lesson_draws(world):
    n, results = world
    initial = [cw.rank_values(r, 4) for r in range(n)]
    total = sum(initial)
    per_rank = torch.stack([cw.rank_values(r, n) for r in range(n)])  # row r: rank r's input
    got = {name: [res["collectives"][name][1] for res in results]
           for name in results[0]["collectives"] if name not in ("barrier", "old_name_warnings")}
    for r in range(n):
        assert torch.equal(got["broadcast"][r], initial[0])
        assert torch.equal(got["all_reduce_sum"][r], total)
        assert torch.allclose(got["all_reduce_avg"][r], total / n)
        assert torch.equal(got["all_gather"][r], torch.cat(initial))
        assert torch.equal(got["all_gather_flat"][r], torch.cat(initial))
        assert torch.equal(got["reduce_scatter"][r], per_rank[:, r].sum().reshape(1))
        assert torch.equal(got["reduce_scatter_flat"][r], per_rank[:, r].sum().reshape(1))
        assert torch.equal(got["all_to_all"][r], per_rank[:, r])
        assert torch.equal(got["send_recv"][r], initial[(r - 1) % n])
    assert torch.equal(got["reduce"][0], total) and got["reduce"][1:] == [None] * (n - 1)
    barrier = [res["collectives"]["barrier"] for res in results]
    assert min(b["left"] for b in barrier) >= max(b["arrived"] for b in barrier)


def test_old_flat_names_warn_only_where_renamed(world):
    _, results = world
    warned = results[0]["collectives"]["old_name_warnings"]
    if hasattr(torch.distributed, "all_gather_single"):  # torch >= 2.13
        assert cw.all_gather_single is torch.distributed.all_gather_single
        assert any(w.startswith("FutureWarning") and "all_gather_single" in w for w in warned)
    else:
        assert cw.all_gather_single is torch.distributed.all_gather_into_tensor


def test_strategy_patterns_match_one_process(world):
    _, results = world
    for res in results:
        assert set(res["patterns"]) == {"DDP", "FSDP", "TP", "PP"}
        assert max(res["patterns"].values()) <= 1e-12, res["patterns"]


def test_old_gloo_fallbacks_give_the_same_answers(world):
    n, results = world
    total = sum(cw.rank_values(r, 4) for r in range(n))
    per_rank = torch.stack([cw.rank_values(r, n) for r in range(n)])
    for r, res in enumerate(results):
        assert torch.allclose(res["fallback"]["avg"], total / n)
        assert torch.equal(res["fallback"]["reduce_scatter"], per_rank[:, r].sum().reshape(1))


def test_timing_grows_with_size(world):
    _, results = world
    (small, t_small), (large, t_large) = results[0]["timing"]
    assert small < large and 0 < t_small < t_large


def test_script_refuses_to_run_without_torchrun():
    proc = run([PYTHON, str(REPO / "lessons" / "collective_workers.py")], check=False,
               timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("start me with torchrun (RANK is not set)")
    assert len(proc.stderr.strip().splitlines()) == 1
