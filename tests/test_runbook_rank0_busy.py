"""The rank-0-busy runbook (runbooks/rank0-busy.md): rank 0 works alone for longer than the
process-group timeout and the other rank fails within seconds, in the place the page says; each
documented fix exits 0; and every error string the page quotes is printed by the drill.

All launches run at once in one module fixture (most of each launch is importing torch, and
the drill's waits are sleeps, so side by side they cost far less than one after another). Each
launch has a hard timeout and the drill itself uses 2-4 s timeouts, so nothing here can hang.
"""

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from launcher import PYTHON, REPO, drill_env, run_drill, torchrun_cmd

DRILL = REPO / "runbooks" / "drills" / "rank0_busy.py"
PAGE = REPO / "runbooks" / "rank0-busy.md"
LAUNCH_TIMEOUT = 120  # per launch; the drill fails in seconds, the rest is start-up on 2 cores
BUSY = ("--timeout-s", "3", "--busy-s", "10")  # the page's numbers (the drill's defaults)




def run_cmd(cmd, env=None):
    return run_drill(cmd, env, LAUNCH_TIMEOUT)


def drill(*args):
    return torchrun_cmd(DRILL, 2, args)


JOBS = {
    "step": (drill(*BUSY), None),
    "init": (drill(*BUSY, "--busy-at", "init"), None),
    "detail": (drill(*BUSY), {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
    "barrier_short": (drill(*BUSY, "--fix", "monitored-barrier", "--wait-s", "4",
                            "--barrier-timeout-s", "2"), None),
    "before_init": (drill(*BUSY, "--fix", "before-init"), None),
    "everyone": (drill(*BUSY, "--fix", "everyone"), None),
    "side_group": (drill(*BUSY, "--fix", "side-group"), None),
    "barrier": (drill(*BUSY, "--fix", "monitored-barrier"), None),
    "long_timeout": (drill("--timeout-s", "20", "--busy-s", "10"), None),
    "crash": (drill(*BUSY, "--rank0-crashes"), None),
    "bad_args": ([PYTHON, DRILL, "--busy-at", "init", "--fix", "side-group"], None),
}


@pytest.fixture(scope="module")
def runs():
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=5) as pool:
        futures = {name: pool.submit(run_cmd, cmd, env and drill_env(**env))
                   for name, (cmd, env) in JOBS.items()}
        results = {name: future.result() for name, future in futures.items()}
    print(f"\nrank0-busy drills: {time.monotonic() - t0:.1f} s wall for {len(results)} launches")
    for name, result in results.items():
        waited = re.findall(r"failed after (\d+\.\d) s", result["out"])
        print(f"  {name:14s} rc {result['rc']} | launch {result['wall_s']:5.1f} s | "
              f"failed after {','.join(waited) or '-'} s | {result['cmd']}")
    return results


def failed_with(result, *texts):
    assert result["rc"] not in (0, None), f"expected a failure:\n{result['out']}"
    for text in texts:
        assert text in result["out"], f"{text!r} missing from:\n{result['out']}"


def seconds_to_fail(result):
    """The drill prints `failed after X s`, measured around the call that raised."""
    found = re.findall(r"failed after (\d+\.\d) s", result["out"])
    assert found, result["out"]
    return min(float(s) for s in found)


def passed(result, *texts):
    assert result["rc"] == 0, result["out"]
    assert "step 3: ok" in result["out"] and result["out"].count("done") >= 2, result["out"]
    for text in texts:
        assert text in result["out"], f"{text!r} missing from:\n{result['out']}"


def test_waiting_rank_times_out_in_the_next_collective(runs):
    result = runs["step"]
    failed_with(result, "rank 0: evaluating alone for 10.0 s",
                "rank 1: all_reduce of step 2 failed after",
                "Timed out waiting 3000ms for recv operation to complete")
    assert 2.5 <= seconds_to_fail(result) < 10, result["out"]  # the 3 s timeout, not 30 min
    assert "step 2: ok" not in result["out"]


def test_torchrun_blames_the_waiting_rank_and_stops_the_busy_one(runs):
    """Root Cause is always the waiting rank 1. Rank 0 is SIGTERMed mid-work when torchrun
    notices rank 1's exit within rank 0's remaining 7 s; on a badly overloaded machine it may
    notice late, so that part is required of at least one of the four busy-rank-0 runs."""
    busy = [runs[name] for name in ("step", "init", "detail", "barrier_short")]
    for result in busy:
        root_cause = result["out"].split("Root Cause")[-1]
        assert re.search(r"rank\s+: 1 \(local_rank: 1\)\n\s+exitcode\s+: 1 ", root_cause), \
            result["out"]
    sigterm = r"rank\s+: 0 \(local_rank: 0\)\n\s+exitcode\s+: -15 \(pid: \d+\)\s+\(SIGTERM\)"
    assert any(re.search(sigterm, r["out"]) for r in busy), busy[0]["out"]


def test_rank0_busy_before_init_fails_inside_init(runs):
    result = runs["init"]
    failed_with(result, "rank 1: init_process_group failed after",
                "DistStoreError: wait timeout after 3000ms, keys: /default_pg/0//cpu//0/0")
    assert 2.5 <= seconds_to_fail(result) < 10, result["out"]


def test_detail_and_monitored_barrier_name_rank0(runs):
    named = ("successfully reached monitoredBarrier, but received errors while waiting for "
             "send/recv from rank 0. Please check rank 0 logs for faulty rank.")
    failed_with(runs["detail"], named)
    failed_with(runs["barrier_short"], named, "Timed out waiting 4000ms for send operation")
    # monitored_barrier(timeout=2 s) did not bound rank 1's wait: the side group's 4 s did.
    assert 3.5 <= seconds_to_fail(runs["barrier_short"]) < 10, runs["barrier_short"]["out"]


def test_a_dead_rank0_fails_the_others_at_once_and_is_the_root_cause(runs):
    """The contrast the page draws: dead, not busy, shows up well before the timeout."""
    result = runs["crash"]
    failed_with(result, "rank 1: all_reduce of step 2 failed after",
                "This is typically caused by a remote worker")
    assert re.search(r"Connection (closed|reset) by peer", result["out"]), result["out"]
    assert seconds_to_fail(result) < 2.5, result["out"]  # rank 0 dies 1 s in; timeout is 3 s
    root_cause = result["out"].split("Root Cause")[-1]
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)\n\s+exitcode\s+: 1 ", root_cause), \
        result["out"]


@pytest.mark.parametrize("name", ["before_init", "everyone", "side_group", "barrier",
                                  "long_timeout"])
def test_documented_fixes_exit_0(runs, name):
    passed(runs[name])


def test_side_group_gets_its_own_timeout_and_new_group_does_not_inherit(runs):
    passed(runs["side_group"], "default group 0:00:03 | side group 0:01:00 | "
           "new_group() without timeout= 0:30:00")


def test_fixes_that_move_the_work_never_wait_on_rank0(runs):
    passed(runs["before_init"], "rank 1: preparing its shard before init_process_group for 5.0 s")
    passed(runs["everyone"], "rank 1: evaluating its shard for 5.0 s")


def test_bad_arguments_exit_2_before_any_process_group(runs):
    assert runs["bad_args"]["rc"] == 2, runs["bad_args"]["out"]
    assert "--fix side-group needs a process group" in runs["bad_args"]["out"]


QUOTES = [  # every error text rank0-busy.md quotes from a CPU run
    "Timed out waiting 3000ms for recv operation to complete",
    "DistStoreError: wait timeout after 3000ms, keys: /default_pg/0//cpu//0/0",
    "waitForInput: poll for socket",
    "returned 0, likely a timeout",
    "Rank 1 successfully reached monitoredBarrier, but received errors while waiting for "
    "send/recv from rank 0. Please check rank 0 logs for faulty rank.",
    "Timed out waiting 4000ms for send operation to complete",
    "exitcode  : -15",
    "(SIGTERM)",
    "default group 0:00:03 | side group 0:01:00 | new_group() without timeout= 0:30:00",
    "Connection closed by peer",
    "This is typically caused by a remote worker crashing.",
]
GPU_ONLY = [  # quoted from the PyTorch source (cited on the page), never run here
    "is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value "
    "store by key '0', but store->get('0') got error: ",
]


def test_page_quotes_what_the_drill_prints(runs):
    text = PAGE.read_text()
    printed = "\n".join(r["out"] for r in runs.values())
    for quote in QUOTES:
        assert quote in text, f"rank0-busy.md does not quote {quote!r}"
        assert quote in printed, f"rank0-busy.md quotes {quote!r}, which no drill printed"


def test_gpu_only_quotes_are_marked_and_sourced():
    text = PAGE.read_text()
    for quote in GPU_ONLY:
        assert quote in text, quote
    assert "GPU only, not executed in CI" in text
    assert "cf1380dfb6c8" in text and "broadcastUniqueNCCLID" in text  # the source it cites


def test_page_names_only_real_drill_flags_and_fixes():
    """Every `--flag` after `rank0_busy.py` on the page is an argparse flag of the drill, and
    every `--fix X` / `--busy-at X` value is one of its choices."""
    source = DRILL.read_text()
    flags = set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', source)) | {"--help"}
    fixes = set(re.findall(r'"([\w-]+)"', re.search(r"FIXES = \[(.*?)\]", source).group(1)))
    seen = 0
    for args in re.findall(r"rank0_busy\.py((?:[ \\\n]+--?[\w-]+(?: +[\w./:=-]+)?)*)",
                           PAGE.read_text()):
        for flag, value in re.findall(r"(--[\w-]+)(?: +([\w.-]+))?", args):
            assert flag in flags, f"rank0_busy.py has no {flag}"
            if flag == "--fix":
                assert value in fixes, f"rank0_busy.py has no --fix {value}"
            if flag == "--busy-at":
                assert value in ("step", "init"), value
            seen += 1
    assert seen >= 10, f"only {seen} drill flags found on the page"
