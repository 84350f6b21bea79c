"""lessons/moe_workers.py, the MoE layer lesson 08 spreads over ranks: its balancing loss and
its capacity, on the cases where the answer is known in closed form."""

import math
import sys

import pytest
import torch

from launcher import REPO

sys.path[:0] = [str(REPO / "lessons")]
import moe_workers as mw  # noqa: E402


def test_the_balancing_loss_is_one_when_uniform_and_e_over_k_when_collapsed():
    num_experts, top_k, tokens = 8, 2, 64
    uniform = mw.balancing_loss(torch.full((num_experts,), tokens * top_k // num_experts),
                                torch.full((num_experts,), tokens / num_experts), tokens, top_k)
    assert math.isclose(float(uniform), 1.0, rel_tol=1e-6)
    collapsed_counts = torch.tensor([tokens, tokens] + [0] * (num_experts - 2))
    collapsed_probs = torch.tensor([tokens / 2, tokens / 2] + [0.0] * (num_experts - 2))
    collapsed = mw.balancing_loss(collapsed_counts, collapsed_probs, tokens, top_k)
    assert math.isclose(float(collapsed), num_experts / top_k, rel_tol=1e-6)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 2.0])
def test_each_expert_drops_exactly_its_excess_and_keeps_the_earliest_tokens(factor):
    x, _ = mw.make_tokens(256, skew=1.0)
    params = mw.make_params()
    with torch.no_grad():
        out, stats = mw.moe_reference(x, params, factor)
        cap = mw.capacity(256, factor)
        assert stats["capacity"] == cap
        assert stats["dropped"] == sum(max(0, int(c) - cap) for c in stats["counts"])
        # Over capacity, an expert keeps its earliest tokens: every lost one comes after them.
        experts, _, _ = mw.route(x, params["router"])
        for e in range(mw.NUM_EXPERTS):
            tokens = (experts == e).any(-1).nonzero().flatten()
            kept, lost = tokens[:cap], tokens[cap:]
            assert lost.numel() == max(0, int(stats["counts"][e]) - cap)
            if lost.numel():
                assert lost.min() > kept.max()


def test_gates_sum_to_one_over_the_chosen_experts():
    x, _ = mw.make_tokens(32)
    experts, gates, probs = mw.route(x, mw.make_params()["router"])
    assert experts.shape == gates.shape == (32, mw.TOP_K)
    assert torch.allclose(gates.sum(-1), torch.ones(32))
    assert torch.allclose(probs.sum(-1), torch.ones(32))
