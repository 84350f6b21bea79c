"""The learner's file: import it by path, refuse it before any rank starts when it does not
import or lacks the adapter's names, and turn what it raises into one line."""

import importlib.util
import sys
import traceback
from pathlib import Path

SOLUTION_MODULE = "graded_solution"

# (text in an exception message, what it usually means)
COMMON_HINTS = (
    ("Connection closed by peer", "another rank stopped first"),
    ("Connection reset by peer", "another rank stopped first"),
    ("Timed out", "a collective that not every rank called?"),
)


class Refusal(Exception):
    """Bad input, found before any rank starts: grade.py prints it in one line, exit 2."""


def display_path(path):
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def one_line(text):
    return " ".join(str(text).split())


def load_solution(path):
    """Import the learner's file by path. Forked ranks find the grader's import already here."""
    path = Path(path).resolve()
    module = sys.modules.get(SOLUTION_MODULE)
    if module is not None and module.__file__ == str(path):
        return module
    spec = importlib.util.spec_from_file_location(SOLUTION_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[SOLUTION_MODULE] = module
    sys.path.insert(0, str(path.parent))  # a solution may import helper files beside it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[SOLUTION_MODULE]
        raise
    return module


def open_solution(exercise, path):
    """The learner's module, or Refusal: a file that does not import or lacks the adapter."""
    try:
        module = load_solution(path)
    except (Exception, SystemExit) as exc:
        raise Refusal(f"could not import {display_path(path)}: "
                      f"{type(exc).__name__}: {one_line(exc)}") from None
    missing = [name for name in exercise.entry_points
               if not callable(getattr(module, name, None))]
    if missing:
        raise Refusal(f"{display_path(path)} does not define {', '.join(missing)}: the grader "
                      f"calls them (see the adapter at the end of exercises/{exercise.stub})")
    return module


def describe_exception(exc, path, hints=()):
    """One line: what the learner's code raised, where (function, file:line), and the usual
    cause when the message is a known one. No traceback."""
    where = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if Path(frame.f_code.co_filename).resolve() == Path(path).resolve():
            qualname = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            where = f"{qualname}, {display_path(path)}:{lineno}"
    text = one_line(exc) or "(no message)"
    if isinstance(exc, NotImplementedError):
        return f"not implemented yet: NotImplementedError: {text}" + (
            f" [{where}]" if where else "")
    out = f"your code raised {type(exc).__name__}: {text}"
    out += f" [{where}]" if where else " [in the grader, on what your code returned]"
    for needle, hint in (*hints, *COMMON_HINTS):
        if needle in text:
            return f"{out} - {hint}"
    return out
