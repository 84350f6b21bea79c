"""Lessons are Jupytext py:percent files; this module turns them into executed notebooks.

One execution serves both the test run (nbval, see conftest.py) and the site build
(tools/site_hooks.py): an executed notebook is cached under build/executed/ together with a
hash of everything that can change its output, and reused only while that hash still matches.
"""

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import jupytext
import nbformat

import verified  # tools/verified.py (this directory is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ROOT / "lessons"
EXECUTED_ROOT = ROOT / "build" / "executed"  # the site reads lessons/NN_x.ipynb from here
EXECUTED = EXECUTED_ROOT / "lessons"
NOTEBOOKS = ROOT / "build" / "notebooks"
LESSON_GLOB = "[0-9][0-9]_*.py"
LAB_GLOB = "lab[0-9][0-9]_*.py"


def lab_paths():
    """labs/labNN_*.py in course order (the tools next to them are not labs)."""
    return sorted((ROOT / "labs").glob(LAB_GLOB))


def lesson_paths():
    return sorted(LESSONS.glob(LESSON_GLOB))


def is_lesson(path):
    path = Path(path)
    return path.parent == LESSONS and path.match(LESSON_GLOB)


def inputs_hash(lesson):
    """Hash of the lesson, its helper modules and the labs it runs, with their kit."""
    digest = hashlib.sha256()
    helpers = [p for p in sorted(LESSONS.glob("*.py")) if not p.match(LESSON_GLOB)]
    labs = sorted((ROOT / "labs").glob("*.py")) + sorted((ROOT / "labs" / "labkit").glob("*.py"))
    for path in [Path(lesson), *helpers, *labs]:
        digest.update(path.relative_to(ROOT).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()


def write_notebook(lesson):
    """Convert lessons/NN_x.py to build/notebooks/NN_x.ipynb (for nbval) and return its path."""
    NOTEBOOKS.mkdir(parents=True, exist_ok=True)
    notebook = jupytext.read(lesson)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    path = NOTEBOOKS / (Path(lesson).stem + ".ipynb")
    nbformat.write(notebook, path)
    return path


def has_errors(notebook):
    return any(out.get("output_type") == "error"
               for cell in notebook.cells if cell.cell_type == "code"
               for out in cell.get("outputs", []))


def executed_path(lesson):
    return EXECUTED / (Path(lesson).stem + ".ipynb")


def cached_executed(lesson):
    """The executed notebook if it is current and error-free, else None."""
    path = executed_path(lesson)
    if not path.exists():
        return None
    notebook = nbformat.read(path, as_version=4)
    current = notebook.metadata.get("course", {}).get("inputs_hash") == inputs_hash(lesson)
    return path if current and not has_errors(notebook) else None


def save_executed(lesson, notebook, source):
    """Store an executed notebook with the facts of the run that executed it (tools/verified.py)."""
    EXECUTED.mkdir(parents=True, exist_ok=True)
    notebook.metadata["course"] = {"inputs_hash": inputs_hash(lesson),
                                   "verified": verified.lesson_facts(source)}
    path = executed_path(lesson)
    tmp = path.with_suffix(".tmp")
    nbformat.write(notebook, tmp)
    os.replace(tmp, path)
    return path


def execute(lesson, source, timeout_s=900, log_path=None):
    """Execute a lesson top to bottom (cell timeout timeout_s); raise on the first error.
    source names who ran it, for the page's stamp ("make course", "the site build").

    log_path: where the kernel's own stdout and stderr go (the lesson's worker processes
    write there too: torch's C++ logs, warnings from ranks). The cells' outputs are in the
    notebook either way; None leaves the kernel's streams on this process's."""
    from nbclient import NotebookClient
    from traitlets.config import Config

    notebook = nbformat.read(write_notebook(lesson), as_version=4)
    os.environ.setdefault("COURSE_ROOT", str(ROOT))
    # IPC (Unix sockets) instead of TCP on localhost: the kernel is this user's alone, and
    # ipykernel warns, rightly, that an unencrypted TCP kernel is open to other local users.
    # The sockets' path must be absolute (the kernel starts in lessons/, the client here) and
    # private (several lessons may run at once).
    with tempfile.TemporaryDirectory(prefix="kernel-") as sockets:
        config = Config({"KernelManager": {"transport": "ipc", "ip": f"{sockets}/ipc"}})
        client = NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                                config=config, resources={"metadata": {"path": str(LESSONS)}})
        if log_path is None:
            client.execute()
        else:
            with open(log_path, "w") as log:
                client.execute(stdout=log, stderr=log)
    return save_executed(lesson, notebook, source)


def ensure_executed(lesson):
    return cached_executed(lesson) or execute(lesson, "the site build")


def main():
    """One lesson, executed in a process of its own: `make course` runs several at a time."""
    parser = argparse.ArgumentParser(description="Execute one lesson into build/executed/.")
    parser.add_argument("lesson", type=Path, help="lessons/NN_x.py")
    parser.add_argument("--log", type=Path, required=True, help="the kernel's own output")
    parser.add_argument("--source", default="make course", help="who ran it, for the stamp")
    args = parser.parse_args()
    try:
        execute(args.lesson, args.source, log_path=args.log)
    except Exception as exc:  # nbclient's CellExecutionError: the failing cell's traceback
        print(exc, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
