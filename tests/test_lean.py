"""Lean copies (`make lean`, tools/lean.py): each lab without its teaching and drill code.

A lean copy, alone in an empty folder with only torch, trains at 2 ranks with losses equal to
the full lab's bit for bit, checkpoints and resumes; its --help has no parity, drill or probe
flag, and its source none of their code."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from launcher import LABS, PYTHON, REPO, forked_run, help_texts, run, run_lab, torchrun_cmd

sys.path.insert(0, str(REPO / "tools"))
import lean  # noqa: E402

LAB_PATHS = lean.lab_paths()  # the labs not on the kit; a lab on it has nothing to strip
TEACHING_FLAGS = ["--check-parity", "--parity-tol", "--fail-at-step", "--fail-rank",
                  "--crash-in-checkpoint", "--stall-at-step", "--count-comms", "--parity-dtype",
                  "--timeline"]
TEACHING_CODE = ["maybe_inject_failure", "maybe_stall", "maybe_crash_mid_checkpoint",
                 "train_reference", "check_parity", "inspect_", "CommDebugMode",
                 "SavedActivation", "measure_state_bytes", "Timeline", "bubble_formula",
                 "analyse_timeline", "# lean:"]
STEPS = ["--steps", "24", "--log-every", "8"]


def lean_copy(lab_path, folder):
    folder.mkdir()
    target = folder / lab_path.name
    target.write_text(lean.lean_source(lab_path.read_text(), lab_path.stem))
    return target


@pytest.fixture(scope="module")
def lean_copies_and_help(tmp_path_factory):
    """{lab path: (its lean copy alone in a folder, the copy's --help, the lab's --help)}; every
    --help from one interpreter (launcher.help_texts), each script run as __main__."""
    root = tmp_path_factory.mktemp("lean")
    copies = {lab_path: lean_copy(lab_path, root / lab_path.stem) for lab_path in LAB_PATHS}
    texts = help_texts([[path] for path in [*copies, *copies.values()]])
    return {lab: (copy, texts[str(copy)], texts[str(lab)]) for lab, copy in copies.items()}


@pytest.mark.parametrize("lab_path", LAB_PATHS, ids=lambda p: p.stem)
def test_a_lean_copy_holds_no_teaching_or_drill_code(lab_path, lean_copies_and_help):
    copy, helptext, full_help = lean_copies_and_help[lab_path]
    source = copy.read_text()
    assert "--check-parity" in full_help  # the full lab has them
    for flag in TEACHING_FLAGS:
        assert flag not in helptext and f'"{flag}"' not in source, flag
    for name in TEACHING_CODE:
        assert name not in source, name
    assert "Lean copy of labs/" in source.splitlines()[2]
    assert len(source.splitlines()) < len(lab_path.read_text().splitlines())


def losses(metrics_path):
    return json.loads(metrics_path.read_text())["losses"]


@pytest.mark.parametrize("lab_path", LAB_PATHS, ids=lambda p: p.stem)
def test_a_lean_copy_alone_trains_like_the_full_lab_and_resumes(lab_path, tmp_path):
    """The lean copy stops at step 12 with a checkpoint, then resumes to 24: its losses are the
    full lab's, bit for bit, before the stop (the same training, less code) and after the
    resume (its checkpoint and resume work)."""
    copy = lean_copy(lab_path, tmp_path / "alone")

    def lean_run(name, *args, fresh):
        """fresh: real torchrun and fresh interpreters, which is what shows the copy runs alone
        with only torch; else ranks forked from the test session's zygote (launcher.forked_run)."""
        out = copy.parent / f"metrics-{name}.json"
        args = [*STEPS, *args, "--metrics-out", str(out)]
        proc = (run(torchrun_cmd(copy, 2, args), cwd=copy.parent, timeout=240) if fresh
                else forked_run(copy, 2, args, timeout=240, cwd=copy.parent))
        return proc, losses(out)

    ckpt = copy.parent / "ckpt"
    with ThreadPoolExecutor(2) as pool:  # the full lab and the lean copy's first leg overlap
        full_run = pool.submit(run_lab, lab_path.stem, 2, STEPS, tmp_path, timeout=240)
        _, first = lean_run("first", "--checkpoint-dir", str(ckpt), "--stop-at-step", "12",
                            fresh=True)
        _, full = full_run.result()
    proc, resumed = lean_run("resumed", "--checkpoint-dir", str(ckpt), fresh=False)
    assert "resumed from" in proc.stdout
    assert first == full["losses"][:12]
    assert resumed == full["losses"][12:]


def test_unbalanced_markers_are_an_error():
    with pytest.raises(ValueError, match="never closed"):
        lean.strip_marked("x = 1\n# lean: begin probes\ny = 2\n")
    with pytest.raises(ValueError, match="without a begin"):
        lean.strip_marked("x = 1\n# lean: end\n")
    assert lean.strip_marked("a = 1\nb = 2  # lean: drop\n# lean: begin x\nc\n# lean: end\nd\n") \
        == "a = 1\nd\n"


def test_make_lean_writes_every_lab(tmp_path):
    proc = subprocess.run(["make", "-s", "lean", f"PY={PYTHON}"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for lab_path in LAB_PATHS:
        assert f"{lab_path.name}: " in proc.stdout and (REPO / "build" / "lean" / lab_path.name).exists()
