"""lessons/context_workers.py, the ring attention lesson 07 runs: the sequence layouts, a ring
of one against plain attention (causal and not), and a 3-rank ring (an odd size the lesson
does not run)."""

import sys

import pytest
import torch

from launcher import REPO

sys.path[:0] = [str(REPO / "lessons")]
import context_workers as cw  # noqa: E402
from spawn import run_workers  # noqa: E402


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_layouts_cover_the_sequence_once_and_unshard_back(layout, world_size):
    full = torch.arange(2 * world_size * 3).reshape(1, -1, 1).float()
    slices = [cw.shard_sequence(full, rank, world_size, layout) for rank in range(world_size)]
    assert sorted(torch.cat(slices, dim=-2).flatten().tolist()) == full.flatten().tolist()
    assert torch.equal(cw.unshard_sequence(slices, layout), full)


def test_a_bad_layout_is_refused():
    with pytest.raises(ValueError, match="unknown layout 'striped'"):
        cw.chunk_ids(0, 2, "striped")


def reference(seq_len, causal):
    q, k, v, dout = cw.make_qkv(seq_len)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = cw.full_attention(q, k, v, causal=causal)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("causal", [True, False])
def test_a_ring_of_one_is_plain_attention(causal):
    q, k, v, dout = cw.make_qkv(48)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = cw.ring_attention(q, k, v, layout="zigzag", causal=causal)
    out.backward(dout)
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, expected in reference(48, causal).items():
        assert (got[name] - expected).abs().max().item() < 1e-5, name


def test_three_ranks_match_one_process():
    """p = 3: the ring's neighbours are not each other's, unlike p = 2."""
    runs = run_workers(cw.ring_parity, 3, 48, ["contiguous", "zigzag"], timeout_s=60)
    for layout in ("contiguous", "zigzag"):
        for name, full in reference(48, causal=True).items():
            got = cw.unshard_sequence([r[layout][name] for r in runs], layout)
            error = (got - full).abs().max().item()
            assert error < 1e-5, (layout, name, error)
