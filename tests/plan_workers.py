"""The processes tests/test_plan_measured.py spawns import their function from here by name
(lessons/spawn.py: a notebook cell or a test module cannot hold them)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "labs"))

import lab04_pipeline  # noqa: E402
from labkit import pipeline  # noqa: E402
from labkit.data import micro_batches  # noqa: E402
from labkit.probes import held_bytes  # noqa: E402


def largest_held_at_each_forward(stages, run_step):
    """Runs one step; at the start of each microbatch's forward, the bytes of the parameters
    and gradients the stages hold (storages counted once: sharded or gathered, whichever FSDP
    has registered then; a DTensor's local part). Returns the largest."""
    held = []

    def measure(module, inputs):
        params = list(module.parameters())
        held.append(held_bytes(params + [p.grad for p in params if p.grad is not None]))

    for stage in stages:
        stage.submod.register_forward_pre_hook(measure)
    run_step()
    return max(held)


def pipeline_stage_held_bytes(rank, world_size, args):
    """One step of lab04 (pipeline x FSDP) on this rank: the most parameter and gradient bytes
    its stage holds at a microbatch's forward, and the parameters of one block."""
    cfg = lab04_pipeline.parse_config(args)
    device = torch.device("cpu")
    scaler = pipeline.pipeline_grad_scaler(None, device)
    mesh, stages, schedule, optimizers = lab04_pipeline.build_pipeline(
        cfg, device, None, pipeline.scaled_loss(scaler))
    batch = next(micro_batches(cfg, mesh.get_local_rank("dp"), cfg.dp, 0))
    peak = largest_held_at_each_forward(stages, lambda: pipeline.train_step(
        cfg, schedule, stages, optimizers, scaler, batch, device))
    block = next(iter(stages[0].submod.layers.values()))
    return {"peak_held": peak, "block_params": sum(p.numel() for p in block.parameters())}


def three_d_stage_held_bytes(rank, world_size, args):
    """The same for lab05 (pipeline x FSDP x TP): a rank holds its tp slice of the stage."""
    import lab05_3d

    cfg = lab05_3d.parse_config(args)
    device = torch.device("cpu")
    scaler = pipeline.pipeline_grad_scaler(None, device)
    mesh, stages, schedule, optimizers = lab05_3d.build_pipeline(
        cfg, device, None, pipeline.scaled_loss(scaler), rank)
    batch = next(micro_batches(cfg, mesh.get_local_rank("dp"), cfg.dp, 0))
    tp_rank = mesh.get_local_rank("tp")
    peak = largest_held_at_each_forward(stages, lambda: pipeline.train_step(
        cfg, schedule, stages, optimizers, scaler, batch, device, reports_loss=tp_rank == 0,
        counted=lab05_3d.counted_once(tp_rank)))
    return {"peak_held": peak}


# What torch's FSDPMemTracker counts as held unsharded: the params FSDP gathered, their
# gradients, and the buffers of the collectives that gather and reduce them.
GATHERED_KINDS = ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter")


class TrackedSteps:
    """Runs a lab's train() with its training loop inside torch's FSDPMemTracker (a dispatch
    mode that counts every tensor storage alive by kind, with no allocator in the count), and
    keeps the largest bytes of each kind, and of GATHERED_KINDS together, after any op."""

    def __init__(self, lab):
        self.lab, self.model, self.largest, self.peak = lab, None, {}, 0
        self.build_fsdp_model, self.train_loop = lab.build_fsdp_model, lab.train_loop
        lab.build_fsdp_model, lab.train_loop = self.capture_model, self.tracked_train_loop

    def capture_model(self, *args, **kwargs):
        self.model = self.build_fsdp_model(*args, **kwargs)
        return self.model

    def tracked_train_loop(self, cfg, rank, device, start_step, optimizers, *args, **kwargs):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(self.model, optimizers[0])
        update = tracker._update_peak_stats  # called after every op, with the bytes alive now

        def sample(*a, **k):
            now = {str(getattr(kind, "value", kind)): n
                   for kind, n in tracker._curr_mem_snap.get(device, {}).items()}
            for kind, n in now.items():
                self.largest[kind] = max(self.largest.get(kind, 0), n)
            gathered = sum(now.get(kind, 0) for kind in GATHERED_KINDS)
            self.largest["gathered"] = max(self.largest.get("gathered", 0), gathered)
            return update(*a, **k)

        tracker._update_peak_stats = sample
        # The tracker's per-module records hold one forward and backward: clear them before
        # each micro-batch's forward, ahead of every module's own hooks.
        def reset_before_the_model(module, inputs):
            if module is self.model:
                tracker.reset_mod_stats()

        reset = torch.nn.modules.module.register_module_forward_pre_hook(reset_before_the_model)
        try:
            with tracker:
                return self.train_loop(cfg, rank, device, start_step, optimizers, *args,
                                       **kwargs)
        finally:
            reset.remove()


def fsdp_held_bytes(rank, world_size, lab_name, args):
    """A few steps of an FSDP lab (lab02, lab07, lab08) on this rank: the largest bytes alive
    of each kind FSDPMemTracker counts, and of what FSDP held unsharded ("gathered")."""
    import importlib

    lab = importlib.import_module(lab_name)
    tracked = TrackedSteps(lab)
    lab.train(lab.parse_config(args), rank, world_size, torch.device("cpu"))
    block = tracked.model.layers["0"]
    return {**tracked.largest, "block_params": sum(p.numel() for p in block.parameters())}


def ddp_bucket_bytes(rank, world_size, args):
    """A few steps of lab01 on this rank, with a comm hook that does DDP's own all-reduce and
    records the size of each gradient bucket the reducer hands it: DDP's copy of the
    gradients, which the plan counts."""
    import lab01_ddp
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buckets, apply_ddp = {}, lab01_ddp.apply_ddp

    def recording_hook(state, bucket):
        buckets[bucket.index()] = bucket.buffer().nbytes
        return allreduce_hook(state, bucket)

    def apply_ddp_recording(*args, **kwargs):
        model = apply_ddp(*args, **kwargs)
        model.register_comm_hook(None, recording_hook)
        return model

    lab01_ddp.apply_ddp = apply_ddp_recording
    lab01_ddp.train(lab01_ddp.parse_config(args), rank, world_size, torch.device("cpu"))
    return {"bucket_bytes": sum(buckets.values()), "buckets": len(buckets)}
