"""The graded exercises (exercises/): each grader passes its reference solution, fails the
untouched stub with a message naming the function to write (no traceback), fails every wrong
solution built by exercises/wrong_solutions.py and names its mistake, refuses bad input in one
line with exit status 2 before any rank starts, and stops a hang. Every grade run is a subprocess with a timeout and
must take under a minute; its wall time is printed (pytest -s shows it)."""

import ast
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXERCISES = REPO / "exercises"
GRADE = EXERCISES / "grade.py"
NAMES = tuple(runpy.run_path(str(EXERCISES / "grading" / "__init__.py"))["EXERCISES"])
MAX_WALL_S = 60
# What an untouched stub's NotImplementedError must name: the first function to write.
STUB_FUNCTIONS = {"ddp": "implement HandDDP.__init__",
                  "zero1": "implement ZeroOneOptimizer.__init__",
                  "fsdp": "implement HandFSDP.__init__",
                  "tp": "implement ColumnParallelLinear.__init__",
                  "moe": "implement dispatch",
                  "pipeline": "implement run_gpipe",
                  "ring": "implement ring_attention_forward"}
# The wrong solutions: each a reference solution with one mistake planted by its edits, and
# what the grader's output must say about that mistake (exercises/wrong_solutions.py).
WRONG = runpy.run_path(str(EXERCISES / "wrong_solutions.py"))
MISTAKES = WRONG["MISTAKES"]
README = (EXERCISES / "README.md").read_text()


def grade(*args, timeout=120):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(GRADE), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - start
    print(f"grade.py {' '.join(map(str, args))}: {wall:.1f} s, exit {proc.returncode}")
    return proc, wall


def check_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith(("PASS", "FAIL"))]


@pytest.mark.parametrize("name", NAMES)
def test_reference_solution_passes(name):
    proc, wall = grade(name, EXERCISES / "solutions" / f"{name}.py")
    lines = check_lines(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines and all(line.startswith("PASS") for line in lines), proc.stdout
    assert proc.stdout.rstrip().endswith(f"verdict: {len(lines)}/{len(lines)} checks passed")
    for line in lines:  # the README lists every check by its name
        assert re.split(r"\s{2,}", line)[1] in README, line
    assert wall < MAX_WALL_S


@pytest.mark.parametrize("name", NAMES)
def test_untouched_stub_fails_naming_the_function(name):
    proc, wall = grade(name)  # no path: the learner's copy, exercises/<name>.py
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert f"grading exercises/{name}.py" in proc.stdout
    first = check_lines(proc.stdout)[0]
    assert first.startswith("FAIL") and "NotImplementedError" in first, first
    assert STUB_FUNCTIONS[name] in first, first
    assert all(line.startswith("FAIL") for line in check_lines(proc.stdout))
    assert "Traceback" not in output
    if name == "ddp":
        assert first in README  # the README shows this very line
    assert wall < MAX_WALL_S


def test_every_wrong_solution_is_described_and_its_edits_apply():
    for name, mistake in MISTAKES.items():
        assert mistake.exercise in NAMES and name.startswith(f"{mistake.exercise}_"), name
        assert mistake.description and "\n" not in mistake.description, f"{name}: one line"
        assert mistake.grader_says, name
        assert mistake.edits and all(old != new for old, new in mistake.edits), name
        source = WRONG["build"](name)  # raises, naming the mistake, unless each edit applies once
        assert ast.get_docstring(ast.parse(source)) == mistake.description, name
    for name in NAMES:  # at least two mistakes per exercise
        assert sum(m.exercise == name for m in MISTAKES.values()) >= 2, name


def test_an_edit_that_no_longer_applies_fails_naming_the_mistake():
    with pytest.raises(ValueError, match="wrong solution ddp_x: an edit's old text occurs 0 times"):
        WRONG["apply_edits"]("ddp_x", "a = 1\n", [("b = 2", "b = 3")])
    with pytest.raises(ValueError, match="wrong solution ddp_x: an edit's old text occurs 2 times"):
        WRONG["apply_edits"]("ddp_x", "a = 1\na = 1\n", [("a = 1", "a = 2")])
    with pytest.raises(ValueError, match="wrong solution ddp_x: two of its edits overlap"):
        WRONG["apply_edits"]("ddp_x", "abcdef\n", [("abcd", "x"), ("cdef", "y")])
    # Edits apply to the reference, not to each other's results: a swap is two edits.
    assert WRONG["apply_edits"]("ddp_x", "x(0)\ny(1)\n", [("0", "1"), ("1", "0")]) == "x(1)\ny(0)\n"


@pytest.mark.parametrize("name", MISTAKES)
def test_wrong_solution_fails_and_the_output_names_the_mistake(name, tmp_path):
    path = write(tmp_path / f"{name}.py", WRONG["build"](name))
    proc, wall = grade(MISTAKES[name].exercise, path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert MISTAKES[name].grader_says in proc.stdout, proc.stdout
    assert "Traceback" not in output
    if name == "ddp_averaged_twice":  # the README shows its first failures
        assert all(line in README for line in check_lines(proc.stdout)[1:3])
    assert wall < MAX_WALL_S


def write(path, text):
    path.write_text(text)
    return path


REFUSALS = {
    "unknown exercise": (lambda tmp: ["fsdp9"], "unknown exercise 'fsdp9'; choose one of: ddp"),
    "missing file": (lambda tmp: ["ddp", tmp / "nope.py"], "no such file:"),
    "does not import": (lambda tmp: ["ddp", write(tmp / "broken.py", "import torch\n1 / 0\n")],
                        "could not import"),
    "lacks the contract": (lambda tmp: ["zero1", write(tmp / "empty.py", "import torch\n")],
                           "does not define make_zero1, local_optimizer"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_bad_input_is_refused_in_one_line(case, tmp_path):
    make_args, expected = REFUSALS[case]
    proc, _ = grade(*make_args(tmp_path), timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""  # refused before any rank (no header, no check line)
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert expected in proc.stderr, proc.stderr
    if case == "does not import":
        assert "ZeroDivisionError: division by zero" in proc.stderr


# The head of a solution that is the reference, but for its finish_gradient_sync.
REFERENCE_DDP = f"""
import importlib.util
import torch
import torch.distributed as dist
path = {str(EXERCISES / "solutions" / "ddp.py")!r}
spec = importlib.util.spec_from_file_location("reference_ddp", path)
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)
make_ddp = reference.make_ddp
"""


def test_a_hang_is_stopped_and_named(tmp_path):
    hang = write(tmp_path / "hang.py", REFERENCE_DDP + """
def finish_gradient_sync(wrapper):
    reference.finish_gradient_sync(wrapper)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # a collective rank 1 never joins
""")
    proc, wall = grade("ddp", hang, "--timeout", "3")
    lines = check_lines(proc.stdout)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("PASS")  # construction calls no finish_gradient_sync
    assert lines[1].startswith("FAIL  grads equal one process (per-parameter)"), lines[1]
    assert "stopped after 3 s, rank 0 never finished it: a hang" in lines[1]
    assert "not run: the grader stopped at the check above" in lines[2]
    assert wall < 30


def test_a_crash_on_one_rank_names_the_rank_and_grading_goes_on(tmp_path):
    crash = write(tmp_path / "crash.py", REFERENCE_DDP + """
def finish_gradient_sync(wrapper):
    if dist.get_rank() == 1 and len(wrapper.buckets) == 2:  # the 8 KiB runs only
        raise ValueError("rank 1 gave up")
    reference.finish_gradient_sync(wrapper)
""")
    proc, wall = grade("ddp", crash)
    lines = check_lines(proc.stdout)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failing = [line for line in lines if line.startswith("FAIL")]
    assert [line.split("  ")[1] for line in failing] == [
        "grads equal one process (buckets of 8 KiB)", "one all-reduce per bucket",
        "params equal one process after 5 SGD steps"], proc.stdout
    assert ("rank 1: your code raised ValueError: rank 1 gave up [finish_gradient_sync"
            in failing[0]), failing[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert wall < MAX_WALL_S


def test_ring_forward_only_passes_the_forward_and_is_not_complete(tmp_path):
    """The ring's backward is optional: not attempted, it does not stop the forward's checks,
    but the verdict counts it as not passed (exercises/README.md says so)."""
    forward_only = write(tmp_path / "forward_only.py", f"""
import importlib.util
path = {str(EXERCISES / "solutions" / "ring.py")!r}
spec = importlib.util.spec_from_file_location("reference_ring", path)
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)
ring_attention_forward = reference.ring_attention_forward

def ring_attention_backward(q, k, v, out, lse, dout, causal):
    raise NotImplementedError("implement ring_attention_backward")
""")
    proc, wall = grade("ring", forward_only)
    lines = check_lines(proc.stdout)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for line in lines:
        if "backward (optional)" in line:
            assert line.startswith("FAIL"), line
            assert "not attempted: NotImplementedError" in line or "the same as above" in line
        else:
            assert line.startswith("PASS"), line
    assert proc.stdout.rstrip().endswith("verdict: 6/9 checks passed"), proc.stdout
    assert wall < MAX_WALL_S
