"""Watching the learner's communication: which torch.distributed collectives their code calls,
how many, with async_op or not, and whether from inside backward.

How "inside backward" is told, without clocks: on CPU every autograd hook has run by the time
loss.backward() returns, so a check wraps that call in `spy.backward()`, and a collective
seen meanwhile was issued from a hook while backward was still running. Counting events,
not timestamps, gives the same answer on any machine at any load.
"""

import contextlib
import inspect
from typing import NamedTuple

import torch.distributed as dist


class Call(NamedTuple):
    name: str  # "all_reduce", ...
    in_backward: bool
    async_op: bool


class CollectiveSpy:
    """While active (`with spy:`), every call to the named torch.distributed functions is
    recorded in `calls`, then made as usual. The learner calls them as dist.all_reduce,
    looked up at call time; a solution that imported the function itself (from
    torch.distributed import all_reduce) holds it in its own globals: patched there too."""

    def __init__(self, solution, names=("all_reduce",)):
        self.solution, self.names = solution, names
        self.calls = []
        self.in_backward = False
        self.calls_at_mark = None

    def mark(self, *_):
        """Note how many calls came so far; usable as a hook (e.g. on the last gradient)."""
        self.calls_at_mark = len(self.calls)

    @contextlib.contextmanager
    def backward(self):
        self.in_backward = True
        try:
            yield
        finally:
            self.in_backward = False

    def _wrap(self, name, original):
        signature = inspect.signature(original)

        def recorded(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            self.calls.append(Call(name, self.in_backward, bool(bound.get("async_op", False))))
            return original(*args, **kwargs)
        return recorded

    def __enter__(self):
        self._patched = []
        for name in self.names:
            original = getattr(dist, name)
            wrapped = self._wrap(name, original)
            targets = [(dist, name)] + [(self.solution, attr) for attr, value
                                        in vars(self.solution).items() if value is original]
            for owner, attr in targets:
                self._patched.append((owner, attr, original))
                setattr(owner, attr, wrapped)
        return self

    def __exit__(self, *exc_info):
        for owner, attr, original in reversed(self._patched):
            setattr(owner, attr, original)


class Message(NamedTuple):
    kind: str  # "send" or "recv"
    peer: int  # the other rank, numbered in the group the message went through
    nbytes: int


class PointToPointSpy:
    """While active (`with spy:`), every point-to-point message this rank posts is recorded in
    `messages`. dist.send, recv, isend, irecv and batch_isend_irecv all end in
    ProcessGroup.send / ProcessGroup.recv, so those two are wrapped on the class: the learner
    may use any of the five, and P2POp's own check (op is dist.isend) still sees the
    original functions. A message is recorded when it is posted, whether or not it completes."""

    def __init__(self):
        self.messages = []

    def _wrap(self, kind, original):
        def recorded(group, tensors, peer, *args, **kwargs):
            self.messages.append(Message(kind, peer, sum(t.nbytes for t in tensors)))
            return original(group, tensors, peer, *args, **kwargs)
        return recorded

    def __enter__(self):
        # Restored from the class's own __dict__: getattr would give the unbound builtin,
        # which, set back on the class, no longer binds self.
        self._originals = {kind: vars(dist.ProcessGroup)[kind] for kind in ("send", "recv")}
        for kind in self._originals:
            setattr(dist.ProcessGroup, kind, self._wrap(kind, getattr(dist.ProcessGroup, kind)))
        return self

    def __exit__(self, *exc_info):
        for kind, original in self._originals.items():
            setattr(dist.ProcessGroup, kind, original)

    def count(self, kind, peer=None):
        return sum(m.kind == kind and (peer is None or m.peer == peer) for m in self.messages)

    def bytes(self, kind, peer=None):
        return sum(m.nbytes for m in self.messages
                   if m.kind == kind and (peer is None or m.peer == peer))
