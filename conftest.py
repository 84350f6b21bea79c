"""Collect lessons/NN_*.py as notebooks and run them through nbval in the same pytest run.

The executed outputs are kept (build/executed/) so the site shows exactly what was tested.
"""

import os
import sys
from pathlib import Path

import nbformat
from nbval.plugin import IPyNbFile

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))
os.environ["COURSE_ROOT"] = str(ROOT)

import lessons as lesson_tools  # noqa: E402  (tools/lessons.py)

_failed_nodeids = set()


class LessonNotebook(IPyNbFile):
    """nbval's notebook collector that also saves the outputs once every cell passed."""

    lesson = None

    def teardown(self):
        super().teardown()
        cells = [item for item in self.session.items if item.parent is self]
        if cells and not any(c.nodeid in _failed_nodeids for c in cells):
            for item in cells:
                item.cell.outputs = item.test_outputs or []
            lesson_tools.save_executed(self.lesson, self.nb)


def pytest_collect_file(file_path, parent):
    if lesson_tools.is_lesson(file_path):
        notebook_path = lesson_tools.write_notebook(file_path)
        collector = LessonNotebook.from_parent(parent, path=notebook_path)
        collector.lesson = file_path
        return collector


def pytest_runtest_logreport(report):
    if report.failed:
        _failed_nodeids.add(report.nodeid)
