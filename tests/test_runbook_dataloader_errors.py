"""Runbooks dataloader-worker-error and dataloader-shared-memory: each drill case produces its
error, each documented fix removes it, and every message the pages quote is one a drill printed
(or, for GPU-only and older-release messages, one found in the installed torch's source).

Launch budget: two python launches of runbooks/drills/dataloader_errors.py (every failure;
every fix, plus the file_system strategy on a full /dev/shm, which must still fail). The shm
cases re-run the drill under `unshare --mount`, so each launch costs two interpreter starts. The failure run is stopped as
soon as its last case (omp-fork) has printed its line: its stuck workers would otherwise cost
the loader's 5 s join each at shutdown. The num_workers=0 cases run in this process.
"""

import importlib.util
import mmap
import os
import re
import signal
import subprocess
import threading
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from launcher import PYTHON, REPO, quiet_env, run

DRILL = REPO / "runbooks" / "drills" / "dataloader_errors.py"
RUNBOOKS = REPO / "runbooks"
WORKER_PAGE, SHM_PAGE = "dataloader-worker-error.md", "dataloader-shared-memory.md"
PAGES = [WORKER_PAGE, SHM_PAGE]
TORCH = Path(torch.__file__).parent
ALL_CASES = ["getitem", "collate", "fd-limit", "fd-limit-feeder", "shm-full", "shm-full-feeder",
             "omp-fork"]

# Every error message the pages quote, as a stable substring (no pid, path, line or fd number),
# with the page that quotes it and where the installed torch has it: (file under torch/, the
# exact text there). None: the text comes from libc or CPython (strerror, OSError).
QUOTES = {
    "Caught KeyError in DataLoader worker process": (
        WORKER_PAGE, ("utils/data/_utils/worker.py", 'where=f"in DataLoader worker process')),
    "Caught RuntimeError in DataLoader worker process": (
        WORKER_PAGE, ("_utils.py", 'msg = f"Caught {self.exc_type.__name__} {self.where}')),
    "Original Traceback (most recent call last):": (
        WORKER_PAGE, ("_utils.py", '.\\nOriginal {self.exc_msg}"')),
    "KeyError: 'label'": (WORKER_PAGE, None),
    "stack expects each tensor to be equal size, but got [3] at entry 0 and [4] at entry 1": (
        WORKER_PAGE, ("lib/libtorch_cpu.so", "stack expects each tensor to be equal size, but got ")),
    "DataLoader timed out after 2.0 seconds": (
        WORKER_PAGE, ("utils/data/dataloader.py", 'f"DataLoader timed out after {self._timeout} seconds"')),
    "Too many open files. Communication with the workers is no longer possible. Please increase "
    "the limit using `ulimit -n` in the shell or change the sharing strategy by calling "
    "`torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning of your code": (
        SHM_PAGE, ("utils/data/dataloader.py", '"Too many open files. Communication with the"')),
    "unable to open shared memory object </torch_": (
        SHM_PAGE, ("lib/libtorch_cpu.so", "unable to open shared memory object <")),
    "> in read-write mode: Too many open files (24)": (
        SHM_PAGE, ("lib/libtorch_cpu.so", "> in read-write mode: ")),
    "OSError: [Errno 24] Too many open files": (SHM_PAGE, None),
    "unable to allocate shared memory(shm) for file </torch_": (
        SHM_PAGE, ("lib/libtorch_cpu.so", "unable to allocate shared memory(shm) for file <")),
    ">: No space left on device (28)": (SHM_PAGE, None),
}
# Quoted but not produced here: (page, file under torch/ or None, text there, or why not there).
NOT_PRODUCED = {
    # GPU only: a forked child that touches CUDA after the parent initialised it.
    "Cannot re-initialize CUDA in forked subprocess. To use CUDA with ": (
        WORKER_PAGE, "cuda/__init__.py"),
    "multiprocessing, you must use the 'spawn' start method": (WORKER_PAGE, "cuda/__init__.py"),
    # The pre-posix_fallocate path; its text is still in the 2.13 library.
    "unable to write to file <": (SHM_PAGE, "lib/libtorch_cpu.so"),
    # CPython's message when a descriptor is stripped from a socket message; torch names it.
    "received 0 items of ancdata": (SHM_PAGE, "utils/data/dataloader.py"),
}


def load_drill():
    spec = importlib.util.spec_from_file_location("dataloader_errors", DRILL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_until_line(cmd, last_prefix, timeout):
    """Run cmd in its own process group, merge its output, and kill the whole group once a line
    starts with `last_prefix` (or after `timeout` s). Returns everything it printed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=quiet_env(), start_new_session=True)
    kill = lambda: os.killpg(proc.pid, signal.SIGKILL)  # noqa: E731
    timer = threading.Timer(timeout, kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(last_prefix):
                break
    finally:
        timer.cancel()
        try:
            kill()
        except ProcessLookupError:
            pass
        proc.stdout.close()
        proc.wait()
    return "".join(lines)


@pytest.fixture(scope="module")
def failures():
    cmd = [PYTHON, str(DRILL), "--case", *ALL_CASES, "--timeout-s", "2"]
    return run_until_line(cmd, "case omp-fork: failed", timeout=180)


WORKER_OSERROR = "OSError: [Errno 24] Too many open files"


@pytest.fixture(scope="module")
def fd_cases_with_oserror(failures):
    """The output of the two fd-limit cases, with the OSError tracebacks that the workers'
    multiprocessing code prints around them (resource_sharer's DupFd, its accept loop, the temp
    dir's removal at exit). Which of them appear is a race: alone, every run here printed some;
    once, on a machine loaded far past its cores, a run printed none. So when `failures` has
    none, the two cases run again, alone, up to three times."""
    output = failures[failures.index("case fd-limit: failed"):failures.index("case shm-full")]
    cmd = [PYTHON, str(DRILL), "--case", "fd-limit", "fd-limit-feeder", "--timeout-s", "2"]
    for _ in range(3):
        if WORKER_OSERROR in output:
            break
        output = run_until_line(cmd, "\0never printed", timeout=60)
    return output


@pytest.fixture(scope="module")
def fixes():
    """Every documented fix, and the one piece of advice that is not a fix for a full /dev/shm
    (file_system), which must still fail."""
    cmd = [PYTHON, str(DRILL), "--case", *ALL_CASES, "--fix", "all", "file-system",
           "--timeout-s", "10"]
    proc = run(cmd, timeout=300, check=False)
    return proc, proc.stdout + proc.stderr


def skip_if_no_namespace(out, case):
    skipped = re.search(rf"^case {case}: skipped: (.*)$", out, re.M)
    if skipped:
        pytest.skip(f"{case} needs a private mount namespace: {skipped.group(1)}")


def failed_line(out, case):
    m = re.search(rf"^case {case}: failed after ([\d.]+) s at batch (\d+): (.*)$", out, re.M)
    assert m, out[-6000:]
    return float(m.group(1)), int(m.group(2)), m.group(3)


# --- dataloader-worker-error: getitem, collate, omp-fork ---------------------------------------

def test_getitem_error_keeps_its_type_and_names_the_worker(failures):
    _, batch, line = failed_line(failures, "getitem")
    # Record 13 is in batch 3; batches go round-robin to the 2 workers, so worker 1 raised.
    assert batch == 3, line
    assert line == ("KeyError: Caught KeyError in DataLoader worker process 1. | original: "
                    "KeyError: 'label'"), line
    block = failures[failures.index("KeyError: Caught KeyError"):]
    assert block.index("Original Traceback (most recent call last):") < block.index(
        "in __getitem__\n    return torch.tensor([record[\"x\"]]), record[\"label\"]")


def test_collate_error_is_wrapped_with_the_stack_message(failures):
    _, batch, line = failed_line(failures, "collate")
    assert batch == 0, line
    assert line == ("RuntimeError: Caught RuntimeError in DataLoader worker process 0. | "
                    "original: RuntimeError: stack expects each tensor to be equal size, but got "
                    "[3] at entry 0 and [4] at entry 1"), line
    assert "in collate_tensor_fn\n    return torch.stack(batch, 0, out=out)" in failures


@pytest.mark.parametrize("case,last_line,frame", [
    ("collate", "RuntimeError: stack expects each tensor to be equal size", "in collate_tensor_fn"),
    ("getitem", "KeyError: 'label'", "in __getitem__"),
])
def test_without_workers_the_error_is_raised_in_the_training_process(case, last_line, frame,
                                                                       capsys):
    drill = load_drill()
    args = drill.parse_args(["--case", case, "--num-workers", "0"])
    assert drill.run_epoch(drill.Run(case, None, args)) is False
    err = capsys.readouterr().err
    assert "Caught" not in err and "Original Traceback" not in err, err
    assert last_line in err and frame in err, err
    assert "dataloader.py" in err and "_worker_loop" not in err  # no worker frames: in-process


def test_omp_pool_inherited_through_fork_hangs_until_the_timeout(failures):
    elapsed, batch, line = failed_line(failures, "omp-fork")
    assert (batch, line) == (0, "RuntimeError: DataLoader timed out after 2.0 seconds"), line
    assert 2.0 <= elapsed <= 12, elapsed


# --- dataloader-shared-memory: fd-limit, shm-full -------------------------------------------

def test_fd_limit_in_the_training_process(failures):
    elapsed, batch, line = failed_line(failures, "fd-limit")
    message, fds = line.split(" | open fds ")
    assert message == "RuntimeError: " + next(q for q in QUOTES if q.startswith("Too many open"))
    open_fds, limit = map(int, re.fullmatch(r"(\d+) of soft limit (\d+)", fds).groups())
    assert limit == 128 and open_fds >= limit - 12, fds  # the loop's kept batches used them up
    assert 1 <= batch < 16 and elapsed < 10, (batch, elapsed)  # 16 descriptors per kept batch


def test_fd_limit_in_a_worker_loses_the_batch_and_the_loader_waits(failures):
    elapsed, batch, line = failed_line(failures, "fd-limit-feeder")
    # The whole line: a worker's traceback glued onto it would break the page's quote.
    assert batch == 0 and re.fullmatch(r"RuntimeError: DataLoader timed out after 2\.0 seconds "
                                       r"\| open fds \d+ of soft limit 128", line), line
    assert 2.0 <= elapsed <= 12, elapsed
    start = failures.index("case fd-limit: failed")
    before = failures[start:failures.index("case fd-limit-feeder: failed")]
    assert re.search(r"in _feed\n(?:.*\n)*?RuntimeError: unable to open shared memory object "
                     r"</torch_\d+_\d+_\d+> in read-write mode: Too many open files \(24\)", before)
    assert "Caught" not in before  # the feeder thread is outside the worker's error wrapper


def test_the_workers_multiprocessing_code_adds_oserrors(fd_cases_with_oserror):
    """More from the worker's multiprocessing code, before the timeout or while it exits."""
    assert WORKER_OSERROR in fd_cases_with_oserror


def test_full_shm_fails_in_the_worker_with_no_space(failures):
    skip_if_no_namespace(failures, "shm-full")
    _, batch, line = failed_line(failures, "shm-full")
    assert re.fullmatch(r"RuntimeError: Caught RuntimeError in DataLoader worker process \d\. \| "
                        r"original: RuntimeError: unable to allocate shared memory\(shm\) for "
                        r"file </torch_\d+_\d+_\d+>: No space left on device \(28\)", line), line
    assert 1 <= batch < 8, batch  # the first batches fit; the ones in flight fill the 8m tmpfs


def test_full_shm_in_the_feeder_thread_loses_the_batch(failures):
    skip_if_no_namespace(failures, "shm-full-feeder")
    elapsed, _, line = failed_line(failures, "shm-full-feeder")
    assert line == "RuntimeError: DataLoader timed out after 2.0 seconds", line
    section = failures[failures.index("case shm-full: failed"):failures.index(
        "case shm-full-feeder: failed")]
    assert re.search(r"in _feed\n(?:.*\n)*?RuntimeError: unable to allocate shared memory\(shm\) "
                     r"for file </torch_\d+_\d+_\d+>: No space left on device \(28\)", section)
    assert 2.0 <= elapsed <= 12, elapsed


def test_file_system_strategy_does_not_help_a_full_shm(fixes):
    _, out = fixes
    skip_if_no_namespace(out, "shm-full")
    _, _, line = failed_line(out, "shm-full --fix file-system")
    assert re.fullmatch(r"RuntimeError: Caught RuntimeError in DataLoader worker process \d\. \| "
                        r"original: RuntimeError: unable to allocate shared memory\(shm\) for "
                        r"file </torch_\d+_\d+_\d+>: No space left on device \(28\)", line), line


# --- the fixes ------------------------------------------------------------------------------

def test_every_documented_fix_removes_its_error(fixes):
    proc, out = fixes
    drill = load_drill()
    assert set(drill.FIXES) == set(ALL_CASES)
    expected = {"getitem": 8, "collate": 8, "fd-limit": 16, "fd-limit-feeder": 16,
                "shm-full": 8, "shm-full-feeder": 8, "omp-fork": 2}
    for case, names in drill.FIXES.items():
        if case.startswith("shm-full"):
            skip_if_no_namespace(out, case)
        for name in names:
            m = re.search(rf"^case {case} --fix {name}: ok: (\d+) batches in [\d.]+ s", out, re.M)
            assert m and int(m.group(1)) == expected[case], (case, name, out[-4000:])
    failed = re.findall(r"^(case .*): failed", out, re.M)
    not_fixes = [f"case {c} --fix {n}" for c, names in drill.NOT_FIXES.items() for n in names]
    assert failed == [n for n in not_fixes if "skipped" not in out], out[-4000:]
    assert proc.returncode == (1 if failed else 0), out[-4000:]


def test_shm_use_follows_the_batches_in_flight(fixes):
    _, out = fixes
    skip_if_no_namespace(out, "shm-full")
    peaks = {name: float(p) for name, p in re.findall(
        r"^case shm-full --fix ([\w-]+): ok: .* peak used ([\d.]+) MiB", out, re.M)}
    batch_mib, slack = 4 * 512 / 1024, 0.5  # 4 samples of --sample-kib 512; tmpfs overhead
    # At most (workers x prefetch_factor + the one the loop holds) batches are in /dev/shm.
    assert 0 < peaks["shm-size"] <= (2 * 2 + 1) * batch_mib + slack, peaks
    assert 0 < peaks["fewer-in-flight"] <= (1 * 1 + 1) * batch_mib + slack, peaks
    assert peaks["fewer-in-flight"] < peaks["shm-size"], peaks
    assert peaks["no-workers"] == 0.0, peaks  # without workers nothing goes through /dev/shm


# --- the pages ------------------------------------------------------------------------------

def page_text(name):
    return (RUNBOOKS / name).read_text()


@lru_cache(maxsize=None)
def torch_file(relative):
    """A file of the installed torch, memory-mapped (libtorch_cpu.so is ~400 MB: not copied)."""
    with open(TORCH / relative, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def in_torch(relative, text):
    return torch_file(relative).find(text.encode()) != -1


@pytest.mark.parametrize("quote", list(QUOTES), ids=lambda q: q[:40])
def test_each_quote_is_on_its_page_in_drill_output_and_in_torch(quote, failures, fixes,
                                                                 request):
    page, source = QUOTES[quote]
    assert quote in page_text(page), f"{page} does not quote {quote!r}"
    out = failures + fixes[1]
    if quote == WORKER_OSERROR:
        out = request.getfixturevalue("fd_cases_with_oserror")
    if "shm(shm)" in quote or "No space left" in quote:
        skip_if_no_namespace(out, "shm-full")
    assert quote in out, f"no drill printed {quote!r}"
    if source:
        assert in_torch(*source), f"{source[1]!r} not in torch/{source[0]}"


@pytest.mark.parametrize("text", list(NOT_PRODUCED), ids=lambda q: q[:40])
def test_messages_not_produced_here_are_in_the_installed_torch(text):
    page, relative = NOT_PRODUCED[text]
    assert text in page_text(page).replace("\n", " "), f"{page} does not quote {text!r}"
    assert in_torch(relative, text), f"{text!r} not in torch/{relative}"


def normalised(line):
    """A traceback or drill line with what changes between runs taken out: paths up to
    site-packages/, lib/python3.N/ or the repo, and every number."""
    line = re.sub(r'File "[^"]*/(?:site-packages|lib/python3\.\d+)/', 'File ".../', line)
    line = line.replace(f'File "{REPO}/', 'File "')
    return re.sub(r"\d+", "N", line.rstrip())


def code_blocks(markdown):
    """(info string, lines) of each fenced code block, indented ones included."""
    blocks, info, lines = [], None, []
    for line in markdown.splitlines():
        fence = re.match(r"^\s*```(\S*)\s*$", line)
        if fence and info is None:
            info, lines = fence.group(1), []
        elif fence:
            blocks.append((info, lines))
            info = None
        elif info is not None:
            lines.append(line)
    return blocks


def symptom_lines(text):
    """Lines of the code blocks under ## Symptoms: drill output, except "..." (lines left out)
    and blocks fenced as ```text (quoted from torch's source or a manual run)."""
    symptoms = text[text.index("## Symptoms"):text.index("## Quick triage")]
    return [line for info, lines in code_blocks(symptoms) if info != "text"
            for line in lines if line.strip() and line.strip() != "..."]


@pytest.mark.parametrize("page", PAGES)
def test_symptom_blocks_are_real_drill_output(page, failures, fixes):
    out = failures + fixes[1]
    if page == SHM_PAGE:
        skip_if_no_namespace(out, "shm-full")
    printed = {normalised(line) for line in out.splitlines()}
    quoted = symptom_lines(page_text(page))
    assert len(quoted) >= 10, quoted
    missing = [line for line in quoted if normalised(line) not in printed]
    assert not missing, missing


def slug(heading):
    """The anchor mkdocs' toc extension gives a heading (its default slugify)."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(path):
    return {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}


def link_problems(name, text):
    problems = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
        if target.startswith("http"):
            continue
        path = RUNBOOKS / name if not target else (RUNBOOKS / target).resolve()
        if target.startswith("../labs/"):  # lab pages are generated from labs/<lab>.py
            path = REPO / "labs" / Path(target).with_suffix(".py").name
        elif target.startswith("../") and not path.exists():
            path = REPO / "docs" / target[3:]  # the site's docs_dir is docs/
        if not path.exists():
            problems.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{target}#{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES)
def test_page_follows_the_skeleton_and_its_links_resolve(page):
    text = page_text(page)
    sections = ["## Symptoms", "## Quick triage", "## Diagnose", "## Causes and fixes",
                "## Reproduce it", "## Prevent", "## Related"]
    assert text.startswith("# ") and "\n> TL;DR:" in text, page
    positions = [text.index(s) for s in sections]
    assert positions == sorted(positions), page
    assert text.isascii(), page
    assert "Looks similar but is" in text, page
    assert "GPU only, not executed in CI" in text or page == SHM_PAGE, page
    assert not link_problems(page, text), link_problems(page, text)


@pytest.mark.parametrize("page", PAGES)
def test_commands_on_the_page_name_real_drill_flags_and_fixes(page):
    drill = load_drill()
    source = DRILL.read_text()
    lines = re.findall(r"^.*runbooks/drills/dataloader_errors\.py.*$", page_text(page), re.M)
    assert lines, page
    for line in lines:
        args = line.split("dataloader_errors.py", 1)[1].split("`")[0].split(" #")[0].split()
        for flag in (a for a in args if a.startswith("--")):
            assert f'"{flag}"' in source, (page, flag)
        if "--case" in args:
            cases = [a for a in args[args.index("--case") + 1:] if not a.startswith("-")]
            cases = cases[:next((i for i, a in enumerate(cases) if a not in drill.CASES),
                                len(cases))]
            assert cases and all(c in drill.CASES for c in cases), (page, line)
        if "--fix" in args:
            names = [a for a in args[args.index("--fix") + 1:] if not a.startswith("-")]
            known = {n for c in drill.FIXES.values() for n in c} | {"all"}
            assert set(names) <= known, (page, line)


# --- bad input, safety, and the checks themselves -------------------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["--num-workers", "-1"], "--num-workers"),
    (["--timeout-s", "0"], "--timeout-s"),
    (["--fd-limit", "8"], "--fd-limit"),
    (["--case", "collate", "--fix", "ulimit"], "--fix"),
    (["--case", "melt"], "--case"),
])
def test_bad_input_is_one_line_and_exit_2(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        load_drill().parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and flag in err, err


def test_the_drill_never_mounts_outside_its_own_namespace(monkeypatch):
    drill = load_drill()
    monkeypatch.delenv(drill.NAMESPACE_MARK, raising=False)
    with pytest.raises(AssertionError, match="refusing to mount"):
        drill.mount_shm("1m")
    monkeypatch.setenv(drill.NAMESPACE_MARK, drill.mount_namespace())  # the same namespace
    with pytest.raises(AssertionError, match="refusing to mount"):
        drill.mount_shm("1m")


def test_the_checks_can_fail():
    assert not in_torch("utils/data/dataloader.py", "a message no torch prints 7f3a")
    assert normalised('  File "/x/lib/python3.11/site-packages/torch/a.py", line 12, in f') == \
        '  File ".../torch/a.py", line N, in f'
    page = ("## Symptoms\n\n```\nRuntimeError: invented\n...\n```\n\n```text\nfrom source\n```\n"
            "\n## Quick triage\n")
    assert symptom_lines(page) == ["RuntimeError: invented"]
    assert link_problems(WORKER_PAGE, "[a](nope.md) [b](dataloader-worker-hangs.md#nope)") == [
        "nope.md", "dataloader-worker-hangs.md#nope"]
    assert slug("B. Collate: `stack expects`") == "b-collate-stack-expects"
    assert slug("/dev/shm too small (containers)") == "devshm-too-small-containers"
