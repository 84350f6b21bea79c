"""The DataLoader runbooks' drills: each documented symptom appears, and each documented fix
removes it. Thresholds are loose enough for a loaded 2-core machine and tight enough to fail
when a fix does nothing.

Launch budget: three torchrun launches (slow input, straggler, straggler timeout) and one
python launch (worker faults); the other drills are imported and run in this process, so they
cost no interpreter start-up.
"""

import importlib.util
import json
import os
import re
import signal
import time
import warnings

import pytest

from launcher import PYTHON, REPO, launch_failed, run, torchrun_cmd

DRILLS = REPO / "runbooks" / "drills"
RUNBOOKS = REPO / "runbooks"
PAGES = ["dataloader-slow-input.md", "dataloader-straggler-rank.md",
         "dataloader-worker-hangs.md", "dataloader-worker-killed.md",
         "dataloader-memory-growth.md", "dataloader-same-order-every-epoch.md"]


def load_drill(name):
    spec = importlib.util.spec_from_file_location(name, DRILLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def results_by_config(payload):
    return {(c["config"]["num_workers"], c["config"]["prefetch_factor"],
             c["config"]["persistent_workers"]): c["per_rank"] for c in payload["results"]}


# --- drill 1: slow input, num_workers / prefetch_factor / persistent_workers -----------------

@pytest.fixture(scope="module")
def slow_input(tmp_path_factory):
    out = tmp_path_factory.mktemp("slow_input") / "slow.json"
    cmd = torchrun_cmd(DRILLS / "dataloader_slow_input.py", 2,
                       ["--configs", "0", "4:2", "4:2:persistent", "--json-out", out])
    proc = run(cmd, timeout=300, check=False)
    if aborted_after_its_work(proc, lines=3 * 2):
        # Seen once in CI (2026-12-03): rank 0 printed every line, then
        # aborted in teardown. It did not recur in 8 runs here, so the drill
        # now enables faulthandler (a recurrence prints where each thread was) and this fixture
        # reruns it once, saying so. Any other failure, or a second abort, fails the tests.
        warnings.warn(f"dataloader_slow_input.py aborted after its work; rerun once:\n"
                      f"{proc.stderr[-3000:]}")
        out.unlink(missing_ok=True)
        proc = run(cmd, timeout=300, check=False)
    if proc.returncode != 0:
        raise launch_failed(proc)
    return proc, results_by_config(json.loads(out.read_text()))


def aborted_after_its_work(proc, lines):
    """Rank 0 printed all its result lines (configs x ranks), then a rank died of SIGABRT."""
    return (proc.returncode != 0 and proc.stdout.count(" | rank ") == lines
            and "terminate called without an active exception" in proc.stderr
            and "exitcode  : -6" in proc.stderr)


def test_slow_input_without_workers_is_data_bound(slow_input):
    _, results = slow_input
    shares = [m["data_share"] for m in results[0, None, False]]
    # Loading a batch (16 x 4 ms) costs more than the step's compute: most of the step waits.
    assert min(shares) >= 0.45, shares


def test_workers_remove_the_data_wait(slow_input):
    _, results = slow_input
    before, after = results[0, None, False], results[4, 2, False]
    worst_before = max(m["data_share"] for m in before)
    worst_after = max(m["data_share"] for m in after)
    assert worst_after <= 0.35 and worst_after <= 0.6 * worst_before, (worst_before, worst_after)
    step_before = max(m["step_ms"] for m in before)
    step_after = max(m["step_ms"] for m in after)
    assert step_after <= 0.8 * step_before, (step_before, step_after)


def test_persistent_workers_skip_the_restart_at_each_epoch(slow_input):
    _, results = slow_input
    restart = min(m["epoch_start_ms"] for m in results[4, 2, False])
    kept = max(m["epoch_start_ms"] for m in results[4, 2, True])
    # Without persistent workers every epoch re-forks the workers and each one pays the
    # 500 ms "open" (--open-ms default) again before its first batch.
    assert restart >= 500 and kept <= restart - 250, (restart, kept)


def test_slow_input_prints_one_line_per_rank_and_config(slow_input):
    proc, results = slow_input
    lines = re.findall(r"workers (\d) \| prefetch (\S) \| persistent (yes|no)\s*\| rank (\d) \| "
                       r"step [\d.]+ ms \| data (\d+)% \| epoch start \d+ ms", proc.stdout)
    assert len(lines) == 6, proc.stdout
    printed = {(int(w), r): int(d) for w, p, keep, r, d in lines if keep == "no"}
    for rank, m in enumerate(results[0, None, False]):
        assert printed[0, str(rank)] == round(100 * m["data_share"])


def test_worker_count_warning_fires_only_past_the_available_cpus(slow_input):
    proc, _ = slow_input
    warned = ("UserWarning: This DataLoader will create 4 worker processes in total. Our "
              "suggested max number of worker in current system is") in proc.stderr
    # The check counts os.sched_getaffinity CPUs against ONE loader's workers.
    assert warned == (len(os.sched_getaffinity(0)) < 4), proc.stderr[-2000:]


# --- drill 3: a straggler rank --------------------------------------------------------------

@pytest.fixture(scope="module")
def straggler(tmp_path_factory):
    out = tmp_path_factory.mktemp("straggler") / "straggler.json"
    cmd = torchrun_cmd(DRILLS / "dataloader_straggler.py", 2,
                       ["--num-workers", "0", "4", "--json-out", out])
    proc = run(cmd, timeout=300)
    payload = json.loads(out.read_text())
    return proc, payload["results"], payload["args"]


def test_straggler_is_the_rank_waiting_on_data(straggler):
    proc, (slow, _), _ = straggler
    straggler_rank, other = slow[1], slow[0]
    assert straggler_rank["slow"] and not other["slow"]
    assert straggler_rank["data_share"] >= 0.5, slow
    assert straggler_rank["data_share"] >= other["data_share"] + 0.25, slow
    # The victim spends the straggler's loading time inside the gradient all_reduce...
    assert other["comm_share"] >= 0.4, slow
    # ...so both ranks log the same step time: step time alone cannot say who is late.
    steps = [m["step_ms"] for m in slow]
    assert max(steps) - min(steps) <= 0.2 * max(steps), steps
    assert "workers 0 | slowest data: rank 1" in proc.stdout
    assert "longest all_reduce wait: rank 0" in proc.stdout


def test_workers_on_the_straggler_release_every_rank(straggler):
    _, (slow, fixed), args = straggler
    # 4 workers feed a batch every 16 samples x 4 ms / 4 = 16 ms, about one step of compute, so
    # some waiting remains (18-46% measured, load-dependent); what must go is most of it...
    assert fixed[1]["data_share"] <= slow[1]["data_share"] - 0.25, (slow, fixed)
    # ...and from the step of every rank, since the other rank was waiting for the straggler,
    # the straggler's read time: batch x io-ms = 64 ms per step with 0 workers, hidden behind
    # compute with 4. At least half of it must go (about 50 ms in one CI run, 65-68 ms in the
    # page's table). A ratio of step times would test this CPU's compute speed instead.
    read_ms = args["batch_size"] * args["io_ms"]
    for before, after in zip(slow, fixed):
        assert before["step_ms"] - after["step_ms"] >= 0.5 * read_ms, (slow, fixed)


def test_straggler_stall_becomes_a_collective_timeout_on_the_other_rank():
    cmd = torchrun_cmd(DRILLS / "dataloader_straggler.py", 2,
                       ["--stall-at-step", "5", "--stall-s", "30", "--timeout-s", "3"])
    proc = run(cmd, timeout=240, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    failed = re.search(r"rank 0: all_reduce\(gradients\) at step 5 failed after ([\d.]+) s: "
                       r".*Timed out waiting 3000ms for recv operation to complete", out)
    assert failed, out
    assert 2.5 <= float(failed.group(1)) <= 15, failed.group(0)  # the timeout, not the 30 s stall
    assert "rank 1: all_reduce" not in out  # the straggler never reached the collective
    # torchrun blames the first rank to fail (the victim) and SIGTERMs the straggler, whose
    # faulthandler dump shows it inside the dataset.
    root_cause = out[out.index("Root Cause (first observed failure)"):]
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)", root_cause), root_cause
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)\n\s+exitcode\s+: -15", out), out
    # The straggler's SIGTERM stack ends on the stall line; the page quotes that frame.
    source = (DRILLS / "dataloader_straggler.py").read_text().splitlines()
    stall_line = next(i for i, line in enumerate(source, 1) if "time.sleep(self.stall_s)" in line)
    frame = f'dataloader_straggler.py", line {stall_line} in __getitem__'
    assert frame in out, out
    assert frame in (RUNBOOKS / "dataloader-straggler-rank.md").read_text()


# --- drill 2: hung, killed and bus-error workers --------------------------------------------

@pytest.fixture(scope="module")
def worker_faults():
    cmd = [PYTHON, str(DRILLS / "dataloader_worker_fault.py"), "--fault", "none", "hang",
           "kill", "sigbus", "segv", "exit", "--timeout-s", "2"]
    proc = run(cmd, timeout=240, check=False)
    return proc, proc.stdout + proc.stderr


def test_healthy_loader_finishes(worker_faults):
    proc, out = worker_faults
    assert re.search(r"fault none: ok: 8 batches in [\d.]+ s", out), out
    assert proc.returncode == 1, out  # the five faults failed, as they should


def test_timeout_turns_a_hung_worker_into_an_error(worker_faults):
    _, out = worker_faults
    m = re.search(r"fault hang: failed after ([\d.]+) s at batch 3: "
                  r"RuntimeError: DataLoader timed out after 2.0 seconds", out)
    assert m, out
    assert 2.0 <= float(m.group(1)) <= 12, m.group(0)


def test_killed_and_crashed_workers_are_named(worker_faults):
    _, out = worker_faults
    died = r"RuntimeError: DataLoader worker \(pid\(s\) \d+\) exited unexpectedly <- RuntimeError: "
    assert re.search(r"fault kill: failed after [\d.]+ s at batch \d+: " + died +
                     r"DataLoader worker \(pid \d+\) is killed by signal: Killed\.", out), out
    assert ("ERROR: Unexpected bus error encountered in worker. This might be caused by "
            "insufficient shared memory (shm).") in out
    assert re.search(r"fault sigbus: failed after [\d.]+ s at batch \d+: " + died +
                     r"DataLoader worker \(pid \d+\) is killed by signal: Bus error\. It is "
                     r"possible that dataloader's workers are out of shared memory\. Please try "
                     r"to raise your shared memory limit\.", out), out
    assert "ERROR: Unexpected segmentation fault encountered in worker." in out
    assert re.search(r"fault segv: .*is killed by signal: Segmentation fault\.", out), out
    assert re.search(r"fault exit: failed after [\d.]+ s at batch \d+: " + died +
                     r"DataLoader worker \(pid \d+\) exited unexpectedly with exit code 3\. "
                     r"Details are lost due to multiprocessing\. Rerunning with num_workers=0 "
                     r"may give better error trace\.", out), out


def test_without_timeout_a_hung_worker_blocks_forever():
    """timeout=0 (the default): the loader's 5 s liveness check sees a live worker and keeps
    waiting. Run in a forked child (its own process group) and kill it after 7 s."""
    drill = load_drill("dataloader_worker_fault")
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 3
        try:
            os.setsid()
            drill.main(["--fault", "hang", "--timeout-s", "0", "--num-workers", "1"])
            code = 0
        finally:
            os._exit(code)
    try:
        time.sleep(7)
        finished, _ = os.waitpid(pid, os.WNOHANG)
    finally:
        os.killpg(pid, signal.SIGKILL)  # the child and its hung worker
        os.waitpid(pid, 0)
    assert finished == 0, "the loader returned or raised instead of hanging"


# --- drill 4: forgotten set_epoch -----------------------------------------------------------

def test_forgotten_set_epoch_is_detected(capsys):
    drill = load_drill("dataloader_set_epoch")
    with pytest.raises(SystemExit) as exc:
        drill.main(["--mode", "forgot"])
    out = capsys.readouterr().out
    assert exc.value.code == 1
    assert ("SAME ORDER: rank 0 epochs 0 and 1 read the data in the identical order "
            "(set_epoch not called?)") in out
    assert "forgot | rank 1 | epoch 2 | sampler.epoch 0 |" in out
    page = (RUNBOOKS / "dataloader-same-order-every-epoch.md").read_text()
    quoted = re.findall(r"^(?:forgot|SAME ORDER).*$", page, re.M)
    assert len(quoted) == 4 and all(line in out for line in quoted), quoted


def test_set_epoch_gives_a_new_order_every_epoch(capsys):
    drill = load_drill("dataloader_set_epoch")
    drill.main(["--mode", "fixed", "--world-size", "4", "--num-samples", "30"])
    out = capsys.readouterr().out
    assert "SAME ORDER" not in out and "COVERAGE" not in out
    assert "ok: 3 epochs, every epoch in a new order on all 4 ranks" in out
    fingerprints = re.findall(r"fixed \| rank 0 \| epoch \d \| sampler.epoch \d \| order (\w+)", out)
    assert len(set(fingerprints)) == 3, out
    drill.main(["--mode", "fixed"])  # the page's example: 2 ranks, 32 samples
    out = capsys.readouterr().out
    page = (RUNBOOKS / "dataloader-same-order-every-epoch.md").read_text()
    quoted = re.findall(r"^(?:fixed \||ok:).*$", page, re.M)
    assert len(quoted) == 4 and all(line in out for line in quoted), (quoted, out)


# --- drill 5: worker memory, Python objects vs one tensor ----------------------------------

def test_python_object_dataset_is_copied_into_every_worker():
    drill = load_drill("dataloader_worker_memory")
    as_list = drill.measure("list", 2, 200_000, 1000)
    as_tensor = drill.measure("tensor", 2, 200_000, 1000)
    assert as_list["checksum"] == as_tensor["checksum"]  # the same records either way
    list_growth, tensor_growth = (r["private_growth_per_worker"] for r in (as_list, as_tensor))
    assert len(list_growth) == len(tensor_growth) == 2
    # Each worker ends up with its own copy of most of the list's pages...
    assert min(list_growth) >= 0.6 * as_list["dataset_bytes"], (list_growth, as_list)
    # ...while the tensor-backed records stay shared.
    assert max(tensor_growth) <= 0.25 * min(list_growth), (tensor_growth, list_growth)


# --- bad input and the pages themselves ----------------------------------------------------

@pytest.mark.parametrize("drill,argv,flag", [
    ("dataloader_slow_input", ["--configs", "0:2"], "--configs"),
    ("dataloader_slow_input", ["--epochs", "1"], "--epochs"),
    ("dataloader_worker_fault", ["--fault", "melt"], "--fault"),
    ("dataloader_worker_fault", ["--num-workers", "0"], "--num-workers"),
    ("dataloader_set_epoch", ["--num-epochs", "1"], "--num-epochs"),
    ("dataloader_worker_memory", ["--num-workers", "0"], "--num-workers"),
    ("dataloader_straggler", ["--slow-rank", "5"], "--slow-rank"),
])
def test_bad_input_is_one_line_and_exit_2(drill, argv, flag, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    module = load_drill(drill)
    parse = module.parse_args if hasattr(module, "parse_args") else module.main
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.count("\n") == 1 and flag in err, err


def test_straggler_refuses_a_world_of_one(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        load_drill("dataloader_straggler").parse_args([])
    assert exc.value.code == 2 and "needs a world of >= 2 ranks" in capsys.readouterr().err


def test_pages_follow_the_skeleton_and_link_to_what_exists():
    sections = ["## Symptoms", "## Quick triage", "## Diagnose", "## Causes and fixes",
                "## Reproduce it", "## Prevent", "## Related"]
    for page in PAGES:
        text = (RUNBOOKS / page).read_text()
        assert text.startswith("# ") and "\n> TL;DR:" in text, page
        positions = [text.index(s) for s in sections]
        assert positions == sorted(positions), page
        assert text.isascii(), page
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if target.startswith("http"):
                continue
            if target.startswith("dataloader-") or target.startswith("drills/"):
                assert (RUNBOOKS / target).exists(), (page, target)


def test_commands_on_pages_name_real_drills_and_flags():
    for page in PAGES:
        text = (RUNBOOKS / page).read_text()
        for line in re.findall(r"^.*runbooks/drills/dataloader_\w+\.py.*$", text, re.M):
            script = re.search(r"runbooks/drills/(dataloader_\w+\.py)", line).group(1)
            source = (DRILLS / script).read_text()
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", line.split(script, 1)[1]):
                assert f'"{flag}"' in source, (page, script, flag)
