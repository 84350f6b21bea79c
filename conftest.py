"""Collect lessons/NN_*.py as notebooks and run them through nbval in the same pytest run.

The executed outputs are kept (build/executed/) so the site shows exactly what was tested.
"""

import os
import sys
from pathlib import Path

from unittest import mock

import jupytext
import nbval.plugin
import pytest
from nbval.plugin import IPyNbFile

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "labs"))  # the labs import their kit, labkit/
os.environ["COURSE_ROOT"] = str(ROOT)

import lessons as lesson_tools  # noqa: E402  (tools/lessons.py)

_failed_nodeids = set()


class LessonNotebook(IPyNbFile):
    """nbval's notebook collector, fed from the Jupytext source (lessons/NN_x.py), that saves
    the outputs once every cell has passed. The node keeps the .py path, so
    `pytest lessons/01_ddp.py` selects it, and the kernel starts in lessons/, as in JupyterLab."""

    def collect(self):
        notebook = jupytext.read(self.path)
        # nbval reads self.fspath with nbformat.read; hand it the converted notebook instead.
        with mock.patch.object(nbval.plugin.nbformat, "read", lambda *args, **kw: notebook):
            yield from super().collect()

    def teardown(self):
        super().teardown()
        cells = [item for item in self.session.items if item.parent is self]
        if cells and not any(c.nodeid in _failed_nodeids for c in cells):
            for count, item in enumerate(cells, 1):
                item.cell.outputs = item.test_outputs or []
                item.cell.execution_count = count  # "In [3]:" on the site, as in JupyterLab
            lesson_tools.save_executed(self.path, self.nb, "the test suite (nbval)")


def pytest_collect_file(file_path, parent):
    if lesson_tools.is_lesson(file_path):
        return LessonNotebook.from_parent(parent, path=file_path)


class NotAPythonTestModule(pytest.File):
    def collect(self):
        return []


def pytest_pycollect_makemodule(module_path, parent):
    """`pytest lessons/01_ddp.py` names the file explicitly, and pytest would then import it as
    a test module (running the whole lesson at collection). The notebook collector above is
    the only way a lesson runs."""
    if lesson_tools.is_lesson(module_path):
        return NotAPythonTestModule.from_parent(parent, path=module_path)


def pytest_runtest_logreport(report):
    if report.failed:
        _failed_nodeids.add(report.nodeid)
