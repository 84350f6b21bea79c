"""What an exercise's checks are made of (exercises/grading/<name>_checks.py imports these).

An exercise defines EXERCISE = Exercise(...): the stub it grades by default, the module-level
names the grader calls in the learner's file (the adapter), and its checks. A check is a
function `check(ctx) -> Result` that runs on every rank of a gloo group of `world_size`
processes; it passes when it passes on every rank.
"""

from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist


@dataclass
class Result:
    passed: bool
    message: str = ""
    diff: float | None = None  # max |diff| against the reference; the worst rank's is shown


def passed(message="", diff=None):
    return Result(True, message, diff)


def failed(message, diff=None):
    return Result(False, message, diff)


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable  # run(ctx) -> Result, called on every rank
    world_size: int = 2


@dataclass(frozen=True)
class Exercise:
    name: str
    stub: str  # the learner's file under exercises/, graded when no path is given
    entry_points: tuple  # module-level callables the grader looks up in the learner's file
    checks: tuple
    hints: tuple = ()  # (text in an exception message, what to tell the learner)
    preload: tuple = ()  # modules the ranks would import lazily: imported once, before forking


class Context:
    """What a check gets on its rank: the learner's module and a way to compare across ranks."""

    def __init__(self, rank, world_size, solution, grader_group):
        self.rank = rank
        self.world_size = world_size
        self.solution = solution
        self.grader_group = grader_group

    def entry(self, name):
        return getattr(self.solution, name)

    def gather(self, obj):
        """obj from every rank, in rank order. Through the grader's own group, so it never
        pairs with a collective the learner's code left behind on the default group."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.grader_group)
        return out
