"""Lessons are Jupytext py:percent files; this module turns them into executed notebooks.

One execution serves both the test run (nbval, see conftest.py) and the site build
(tools/site_hooks.py): an executed notebook is cached under build/executed/ together with a
hash of everything that can change its output, and reused only while that hash still matches.
"""

import hashlib
import os
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
    """Hash of the lesson, its helper modules and the labs it runs."""
    digest = hashlib.sha256()
    helpers = [p for p in sorted(LESSONS.glob("*.py")) if not p.match(LESSON_GLOB)]
    for path in [Path(lesson), *helpers, *sorted((ROOT / "labs").glob("*.py"))]:
        digest.update(path.name.encode() + path.read_bytes())
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


def execute(lesson, source, timeout_s=900):
    """Execute a lesson top to bottom (cell timeout timeout_s); raise on the first error.
    source names who ran it, for the page's stamp ("make course", "the site build")."""
    from nbclient import NotebookClient

    notebook = nbformat.read(write_notebook(lesson), as_version=4)
    os.environ.setdefault("COURSE_ROOT", str(ROOT))
    client = NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(LESSONS)}})
    client.execute()
    return save_executed(lesson, notebook, source)


def ensure_executed(lesson):
    return cached_executed(lesson) or execute(lesson, "the site build")
