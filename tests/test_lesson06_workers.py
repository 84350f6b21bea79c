"""lessons/perf_workers.py, the traces lesson 06 measures overlap from: at a small width, in
one 2-rank group, each strategy's step yields compute on the training thread and gloo's
collectives, the ones that strategy must issue."""

import sys

import pytest

from launcher import LABS, REPO

sys.path[:0] = [str(REPO / "lessons"), str(LABS)]
import perf_workers  # noqa: E402
from spawn import run_workers  # noqa: E402


@pytest.fixture(scope="module")
def traces():
    per_rank = run_workers(perf_workers.profiled_steps, 2, ("ddp", "fsdp", "fsdp-async"), 64,
                           2, timeout_s=60)
    return per_rank


def names(events, kind):
    return {name for k, name, _, _ in events if k == kind}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp-async"])
def test_each_step_has_compute_and_gloo_intervals(traces, strategy):
    for rank in traces:
        events = rank[strategy]
        assert all(end >= start for _, _, start, end in events)
        assert names(events, "compute") and all(n.startswith("aten::")
                                                for n in names(events, "compute"))
        assert names(events, "comm") and all(n.startswith("gloo:")
                                             for n in names(events, "comm"))


def test_ddp_all_reduces_and_fsdp_gathers_and_reduces(traces):
    for rank in traces:
        assert any("all_reduce" in n or "allreduce" in n for n in names(rank["ddp"], "comm"))
        for strategy in ("fsdp", "fsdp-async"):
            comm = names(rank[strategy], "comm")
            assert any("gather" in n for n in comm), comm
            assert any("reduce" in n for n in comm), comm


def test_the_order_facts_lesson_06_asserts(traces):
    """At any width and on any load: DDP issues all-reduces during backward, FSDP2's default
    gathers each block only when it is about to run, and the async variant gathers the next
    block while the current one computes."""
    for rank in traces:
        during, issued = perf_workers.allreduces_issued_during_backward(rank["ddp"])
        assert issued >= 1 and during == issued - 1, (during, issued)
        assert perf_workers.allreduces_issued_during_backward(rank["fsdp"]) == (0, 0)
        assert perf_workers.prefetched_in_forward(rank["fsdp"], 2) == [False]
        assert perf_workers.prefetched_in_forward(rank["fsdp-async"], 2) == [True]


def test_the_private_async_unshard_switch_still_exists():
    """fsdp-async relies on FSDPModule._set_unshard_async_op (private, shown on purpose in the
    lesson): fail here, by name, if a torch upgrade removes it."""
    from torch.distributed.fsdp import FSDPModule

    assert callable(getattr(FSDPModule, "_set_unshard_async_op", None))
