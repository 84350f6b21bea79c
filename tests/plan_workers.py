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


def pipeline_stage_held_bytes(rank, world_size, args):
    """One step of lab04 (pipeline x FSDP) on this rank. At the start of each microbatch's
    forward, the bytes of the parameters and gradients the stage holds (storages counted once:
    sharded or gathered, whichever FSDP has registered then). Returns the largest, and the
    parameters of one block."""
    cfg = lab04_pipeline.parse_config(args)
    device = torch.device("cpu")
    scaler = pipeline.pipeline_grad_scaler(None, device)
    mesh, stages, schedule, optimizers = lab04_pipeline.build_pipeline(
        cfg, device, None, pipeline.scaled_loss(scaler))
    held = []

    def measure(module, inputs):
        params = list(module.parameters())
        held.append(held_bytes(params + [p.grad for p in params if p.grad is not None]))

    for stage in stages:
        stage.submod.register_forward_pre_hook(measure)
    batch = next(micro_batches(cfg, mesh.get_local_rank("dp"), cfg.dp, 0))
    pipeline.train_step(cfg, schedule, stages, optimizers, scaler, batch, device)
    block = next(iter(stages[0].submod.layers.values()))
    return {"peak_held": max(held), "per_microbatch": held,
            "block_params": sum(p.numel() for p in block.parameters())}
