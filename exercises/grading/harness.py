"""The grader's runner, shared by every exercise: start the ranks, run the checks under a
wall-clock limit, print one line per check and a verdict (checks.py: what a check is;
solution.py: the learner's file).

How the ranks run: the grader forks the ranks (spawns them where fork does not exist); each
joins a gloo group on 127.0.0.1 with an explicit timeout, runs its checks in order and sends
each result back through a queue. When a check raises on any rank (the learner's code
crashed, or a stub raised NotImplementedError), that set of ranks is done for: another rank
may sit inside a collective the failed rank will never join, and a later check would pair
its collectives with stale ones. So the grader kills them and starts fresh ranks at the next
check (a fork and a gloo rendezvous: about 30 ms). A check that runs past the limit is a
hang: the grader kills the ranks, names the check, and stops there.
"""

import datetime
import importlib
import multiprocessing
import queue as queue_lib
import socket
import sys
import time

import torch
import torch.distributed as dist

from . import EXERCISES
from .checks import Context, failed, passed
from .solution import describe_exception, display_path, load_solution, one_line, open_solution

# Every collective gives up after this; the per-check limit (--timeout, 30 s by default) stops
# a hang first, so this one only matters if the grader itself is killed while ranks wait.
PG_TIMEOUT = datetime.timedelta(seconds=60)
DEFAULT_CHECK_TIMEOUT_S = 30.0
# After one rank fails, the others get this long to report before they are stopped (a rank
# waiting in a collective for the failed one gets "Connection closed by peer" at once).
CRASH_GRACE_S = 2.0
# Fork copies the grader's imports (torch, the learner's file) into each rank, so ranks start
# in milliseconds. It is safe here because the grader process has run no torch op and holds
# no thread that takes a lock. macOS and Windows do not fork safely: spawn (slower) there.
START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"


def load_exercise(name):
    return importlib.import_module(f".{EXERCISES[name]}", __package__).EXERCISE


def _rank_main(rank, world_size, port, exercise_name, solution_path, indices, events):
    torch.set_num_threads(1)  # the ranks share the machine's cores; the checks are tiny
    exercise = load_exercise(exercise_name)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=PG_TIMEOUT)
        grader_group = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
        # Nobody leaves setup while a peer is still connecting: a rank whose first check
        # fails at once would otherwise cut a slower peer's connection mid-handshake.
        dist.barrier(group=grader_group)
        solution = load_solution(solution_path)
    except Exception as exc:
        events.put(("setup", rank, None, f"{type(exc).__name__}: {one_line(exc)}"))
        return
    ctx = Context(rank, world_size, solution, grader_group)
    for index in indices:
        try:
            result = exercise.checks[index].run(ctx)
        except BaseException as exc:  # the learner's code crashed, or a stub is unwritten
            events.put(("error", rank, index,
                        describe_exception(exc, solution_path, exercise.hints)))
            return  # leaving closes this rank's sockets, so a peer waiting on it fails fast
        events.put(("result", rank, index, result))
    events.put(("done", rank, None, None))
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _merge(by_rank, world_size):
    """One Result from every rank's: the lowest failing rank's, or the worst diff if all pass."""
    for rank in sorted(by_rank):
        result = by_rank[rank]
        if not result.passed:
            if world_size > 1 and not all(not r.passed for r in by_rank.values()):
                result.message = f"rank {rank}: {result.message}"
            return result
    diffs = [r.diff for r in by_rank.values() if r.diff is not None]
    return passed(by_rank[0].message, max(diffs) if diffs else None)


class _Watch:
    """Reads the ranks' events until their checks are done, one fails, or time runs out."""

    def __init__(self, ranks, events, indices, timeout_s, report):
        self.ranks, self.events, self.report = ranks, events, report
        self.pending = list(indices)  # checks not reported yet, in order
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.results = {}  # index -> {rank: Result}
        self.done = set()
        self.error = None  # (index, message): the first failure of any rank
        self.errors = {}  # rank -> message, for the check that failed
        self.error_rank = None
        self.error_deadline = None
        self.setup_error = None
        self.dead_since = {}

    def run(self):
        """("finished" | "crashed" | "hang" | "setup", index, message)"""
        while self.pending:
            try:
                self.handle(*self.events.get(timeout=0.05))
                continue  # drain every queued event before judging exits and time
            except queue_lib.Empty:
                pass
            now = time.monotonic()
            if self.setup_error:
                return "setup", self.pending[0], self.setup_error
            if self.error is None:
                self.notice_silent_exits(now)
            if self.error and (now > self.error_deadline or self.all_exited()):
                return "crashed", self.error[0], self.crash_message()
            if now > self.deadline:
                index = self.pending[0]
                waiting = [r for r in range(len(self.ranks))
                           if r not in self.results.get(index, {})]
                return "hang", index, f"rank {', '.join(map(str, waiting))} never finished it"
        return "finished", None, None

    def handle(self, kind, rank, index, payload):
        if kind == "result":
            self.results.setdefault(index, {})[rank] = payload
            if len(self.results[index]) == len(self.ranks):
                self.report(index, _merge(self.results.pop(index), len(self.ranks)))
                self.pending.remove(index)
                self.deadline = time.monotonic() + self.timeout_s
        elif kind == "error":
            self.errors[rank] = payload
            if self.error is None:
                self.error, self.error_rank = (index, payload), rank
                self.error_deadline = time.monotonic() + CRASH_GRACE_S
        elif kind == "setup" and self.error is None:
            self.setup_error = self.setup_error or payload
        elif kind == "done":
            self.done.add(rank)

    def notice_silent_exits(self, now):
        """A rank that exits without a word (os._exit, a segfault) fails the running check; it
        is judged dead only after 0.5 s, so an event it sent just before exiting arrives first."""
        for rank, process in enumerate(self.ranks):
            if process.exitcode is None or rank in self.done:
                continue
            since = self.dead_since.setdefault(rank, now)
            if now - since > 0.5:  # crash_message() names it
                self.error, self.error_rank = (self.pending[0], None), rank
                self.error_deadline = now + CRASH_GRACE_S
                return

    def crash_message(self):
        """A rank that vanished without a word is the cause (its peers only saw their
        connections drop); else the first error, naming its rank unless every rank said it."""
        for rank, process in enumerate(self.ranks):
            if process.exitcode is not None and rank not in self.errors and rank not in self.done:
                return f"rank {rank} exited with code {process.exitcode} during this check"
        message = self.error[1]
        if len(self.ranks) > 1 and not (len(self.errors) == len(self.ranks)
                                        and len(set(self.errors.values())) == 1):
            message = f"rank {self.error_rank}: {message}"
        return message

    def all_exited(self):
        return all(process.exitcode is not None for process in self.ranks)


def _run_ranks(exercise, solution_path, indices, world_size, timeout_s, report):
    context = multiprocessing.get_context(START_METHOD)
    events = context.Queue()
    args = (world_size, _free_port(), exercise.name, str(solution_path), list(indices), events)
    ranks = [context.Process(target=_rank_main, args=(rank, *args), daemon=True)
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    status = None
    try:
        status, index, message = _Watch(ranks, events, indices, timeout_s, report).run()
        return status, index, message
    finally:
        # Ranks that finished get a moment to leave on their own; any other is killed.
        end = time.monotonic() + (2.0 if status == "finished" else 0.0)
        for process in ranks:
            process.join(timeout=max(0.0, end - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()


def grade(exercise, solution_path, timeout_s=DEFAULT_CHECK_TIMEOUT_S):
    """Run every check of `exercise` on the learner's file; print the report; 0 if all pass."""
    open_solution(exercise, solution_path)  # Refusal before any rank starts
    for module in exercise.preload if START_METHOD == "fork" else ():
        importlib.import_module(module)
    checks = exercise.checks
    width = max(len(check.name) for check in checks)
    outcomes = {}
    last_failure = [None]

    def report(index, result):
        outcomes[index] = result
        status = "PASS" if result.passed else "FAIL"
        detail = [f"max |diff| {result.diff:.1e}"] if result.diff is not None else []
        if not result.passed and result.message == last_failure[0]:
            detail.append("the same as above")  # e.g. every check of an untouched stub
        elif result.message:
            detail.append(result.message)
        if not result.passed:
            last_failure[0] = result.message
        print(f"{status}  {checks[index].name:<{width}}  {' - '.join(detail)}".rstrip(),
              flush=True)

    sizes = sorted({check.world_size for check in checks})
    print(f"grading {display_path(solution_path)} (exercise {exercise.name}): {len(checks)} "
          f"checks, gloo on 127.0.0.1 at {' and '.join(map(str, sizes))} ranks, "
          f"{timeout_s:g} s limit per check", flush=True)
    start, setup_tries = 0, 0
    while start < len(checks):
        world_size = checks[start].world_size
        stop = start
        while stop < len(checks) and checks[stop].world_size == world_size:
            stop += 1
        status, index, message = _run_ranks(exercise, solution_path, range(start, stop),
                                            world_size, timeout_s, report)
        if status == "crashed":
            report(index, failed(message))
        if status in ("finished", "crashed"):
            # On from the first check not reported yet (a crash in check i+1 on one rank can
            # stop a slower rank before it reported check i: check i runs again).
            start = next((i for i in range(start, len(checks)) if i not in outcomes),
                         len(checks))
        elif status == "setup" and setup_tries == 0:
            setup_tries += 1  # most likely the free port was taken meanwhile: once more
        else:
            why = (f"stopped after {timeout_s:g} s, {message}: a hang (a collective that not "
                   f"every rank called? a wait on work that was never launched?)"
                   if status == "hang" else f"could not start {world_size} ranks: {message}")
            report(index, failed(why))
            for later in range(index + 1, len(checks)):
                report(later, failed("not run: the grader stopped at the check above"))
            break
    num_passed = sum(result.passed for result in outcomes.values())
    print(f"verdict: {num_passed}/{len(checks)} checks passed", flush=True)
    return 0 if num_passed == len(checks) else 1
