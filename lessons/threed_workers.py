"""Worker functions for lessons/05_3d.py (run with spawn.run_workers).

Each rank builds labs/lab05_3d.py's pipeline on the ("pp", "dp", "tp") mesh and runs one
training step with two recorders on: every collective and point-to-point op this rank issues,
by mesh axis, with the moment it was issued; and the start and end of every stage forward and
backward. The second step is the one recorded (the first also infers the pipeline's shapes).
Times are time.perf_counter() readings, the same clock in every process of one machine.
"""

import contextlib
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import lab05_3d as lab

# c10d_functional ops that wait for, or wrap, an operation counted when it was issued.
NOT_AN_OPERATION = {"wait_tensor", "_wrap_tensor_autograd"}


class AxisRecorder(TorchDispatchMode):
    """Every c10d and c10d_functional op dispatched while active: (axis, op, perf_counter time,
    bytes of its largest tensor argument).

    FSDP's all-gathers and reduce-scatters and the pipeline's sends and receives are c10d ops
    that carry their ProcessGroup; TP's collectives come from DTensor as c10d_functional ops
    that carry the group's name. Either way the group names the mesh axis. (A public-API
    alternative, CommDebugMode, counts by op but not by group; TorchDispatchMode is the
    documented way to see ops, from torch.utils._python_dispatch.)"""

    def __init__(self, groups):
        super().__init__()
        self.axis_by_name = {g.group_name: axis for axis, g in groups.items()}
        self.events = []

    def axis_of(self, args):
        for a in args:
            for item in a if isinstance(a, (list, tuple)) else [a]:
                if isinstance(item, str) and item in self.axis_by_name:
                    return self.axis_by_name[item]
                if isinstance(item, torch.ScriptObject):
                    with contextlib.suppress(RuntimeError):  # a ReduceOp is one too
                        return self.axis_by_name[dist.ProcessGroup.unbox(item).group_name]
        return "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func._opname
            if name not in NOT_AN_OPERATION:
                tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                           if isinstance(t, torch.Tensor)]
                self.events.append((self.axis_of(args), name, time.perf_counter(),
                                    max((t.nbytes for t in tensors), default=0)))
        return out


def time_stage_actions(stage, actions):
    """Wrap the stage's forward and backward (what every schedule calls) with a clock."""
    def timed(kind, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            actions.append((kind, stage.stage_index, args[0], start, time.perf_counter()))
            return out
        return wrapper
    stage.forward_one_chunk = timed("F", stage.forward_one_chunk)
    stage.backward_one_chunk = timed("B", stage.backward_one_chunk)


def one_recorded_step(rank, world_size, lab_args):
    """Returns this rank's coordinates, its ops by axis and its stage actions of step 2."""
    cfg = lab.parse_config(lab_args)
    device = torch.device("cpu")
    scaler = lab.pipeline.pipeline_grad_scaler(None, device)
    mesh, stages, schedule, optimizers = lab.build_pipeline(cfg, device, None,
                                                            lab.pipeline.scaled_loss(scaler), rank)
    groups = {axis: mesh[axis].get_group() for axis in ("pp", "dp", "tp")}
    groups["world"] = dist.group.WORLD
    batches = lab.micro_batches(cfg, mesh.get_local_rank("dp"), cfg.dp, 0)
    tp_rank = mesh.get_local_rank("tp")
    step_options = dict(reports_loss=tp_rank == 0, counted=lab.counted_once(tp_rank))
    lab.pipeline.train_step(cfg, schedule, stages, optimizers, scaler, next(batches), device,
                            **step_options)
    actions = []
    dist.barrier()  # start the step together
    # perf_counter reads CLOCK_MONOTONIC, one clock for every process on a machine: times from
    # different ranks compare exactly (a barrier alone leaves them apart by however long each
    # process waited for a core, several ms with 8 processes on 2 cores).
    start = time.perf_counter()
    for stage in stages:
        time_stage_actions(stage, actions)
    with AxisRecorder(groups) as recorder:
        lab.pipeline.train_step(cfg, schedule, stages, optimizers, scaler, next(batches),
                                device, **step_options)
    step_s = time.perf_counter() - start
    counts = Counter((axis, op) for axis, op, _, _ in recorder.events)
    return {"coords": {a: mesh.get_local_rank(a) for a in ("pp", "dp", "tp")},
            "stages": [s.stage_index for s in stages], "counts": dict(counts),
            "events": recorder.events, "actions": actions, "start": start, "step_s": step_s}
