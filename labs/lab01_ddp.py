"""Lab 01: DistributedDataParallel (DDP), from one process to many.

What it teaches: every rank holds a full replica; after backward, DDP all-reduces the gradients
(bucketed, overlapped with backward) so every replica takes the same optimizer step. The run
proves it: `--check-parity` retrains the same global batches in one process and compares every
parameter (fp32 on CPU: max |diff| must be <= 1e-5).

Launch (the same file everywhere; the backend follows the hardware):
    python labs/lab01_ddp.py                                   # 1 process, no torchrun
    torchrun --nproc-per-node 2 labs/lab01_ddp.py --check-parity   # CPU + gloo, or GPUs + nccl
    torchrun --nproc-per-node 8 labs/lab01_ddp.py              # one node with 8 GPUs
    # two nodes (run on each; same --rdzv-id everywhere, node 0's address as the endpoint):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD_NODE:29400 --rdzv-id $JOB_ID labs/lab01_ddp.py

Minimum world size: 1. Expected last line of the --check-parity run at 2 ranks (numbers vary
slightly with hardware):
    done | lab01_ddp | gloo x2 | 40 steps | loss 0.46... | parity 0.0e+00 | ...
Lesson: lessons/01_ddp.py. Runbooks: runbooks/ (OOM, NCCL hangs, DataLoader stalls).

Copy it: this file and the folder labkit/ beside it (torch and the standard library are all
they need). This file is the DDP part, in the order it happens; labkit/ holds the rest once:
flags, model, data, the loop and its log, metrics, --plan, --check-parity and the fault drills.

Use it in your project:
  - Replace: `build_model()` (labkit/model.py: your model, your init), `SyntheticSequences`
    (labkit/data.py: your Dataset, still dealt out by `micro_batches()`), `loss_fn()` and the
    batch unpacking in `train_step()` (labkit/). `--check-parity` (fp32) tests the port.
  - Keep: `init_distributed()` with `attempt_store()` (restarts: runbooks/restart-hang.md);
    set_epoch in `micro_batches()` (runbooks/dataloader-same-order-every-epoch.md); models
    made inside `run()` and freed before `teardown_distributed()` (runbooks/exit-hang.md,
    cause D); `save_checkpoint()`: rank 0 writes a temp file and renames it, no "module.".
  - Pitfalls: a parameter that gets no gradient makes DDP raise at the next step ("Expected to
    have finished reduction ..."): pass find_unused_parameters=True to DDP in `apply_ddp()`.
    Ranks running different step counts fail or hang at the end (runbooks/exit-hang.md, cause
    B). High "data NN%" in the log: raise `--num-workers` (runbooks/dataloader-slow-input.md).
    Out of memory: raise `--grad-accum` to shrink the micro-batch (runbooks/oom-mitigations.md).
"""

import contextlib
import datetime
import itertools
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.checkpoint import (latest_checkpoint, restore_rng_state, rng_state,
                               save_file_atomically)
from labkit.data import ResumableDistributedSampler, build_dataset, make_loader
from labkit.errors import fail_config
from labkit.flags import make_parser, planned_world_size, validate_common
from labkit.loop import announce, train_loop, train_step
from labkit.metrics import finish_run
from labkit.model import build_model
from labkit.plan import plan_or_refuse
from labkit.runtime import (attempt_store, become_a_world_of_one, compute_dtype,
                            make_grad_scaler, pick_device_type, precision_name,
                            teardown_distributed)

LAB_NAME = "lab01_ddp"


def parse_config(argv=None):
    parser = make_parser(LAB_NAME, __doc__)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="DDP gradient bucket size; one all-reduce per full bucket")
    cfg = parser.parse_args(argv)
    world_size = planned_world_size(cfg)
    validate_common(cfg, world_size, dp_size=world_size)
    if cfg.bucket_cap_mb <= 0:
        fail_config("--bucket-cap-mb", f"must be > 0, got {cfg.bucket_cap_mb}")
    plan_or_refuse(cfg, plan_layout(cfg, world_size), world_size)
    return cfg


def plan_layout(cfg, world_size):
    """What each rank holds under DDP, for --plan and the fit check (labkit/plan.py)."""
    return {"mesh": f"dp={world_size}", "what": "DDP: a full replica per rank",
            "precision": "autocast over fp32 weights; gradients all-reduced in fp32 buckets",
            "state_shards": 1, "optimizer_shards": 1, "tp": 1, "layers": cfg.num_layers,
            "in_flight": 1, "micro_batch": cfg.batch_size // (world_size * cfg.grad_accum),
            "fsdp": False, "ddp_buckets": True}


def init_distributed(cfg):
    """Join the process group: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE for each process
    (without torchrun, become a world of one). Returns (rank, world_size, device)."""
    become_a_world_of_one()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    # Every collective may block this long before it becomes an error naming what it waited
    # for; without it a dead peer hangs the others for the backend's default (10-30 min).
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    store = attempt_store(rank, world_size, timeout)
    if pick_device_type(cfg) == "cuda":
        # set_device first: device_id= binds the communicator to this GPU anyway, but every
        # tensor made on plain "cuda" (ours, or a library's) would land on cuda:0.
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    return rank, world_size, device


def micro_batches(cfg, rank, world_size, start_step, pin_memory=False):
    """This rank's micro-batches, forever, from optimizer step `start_step` on."""
    dataset = build_dataset(cfg)
    # Each rank reads a disjoint 1/world_size of every epoch: the sampler shuffles all indices
    # with the same seed on every rank, then deals them out round-robin. drop_last: every rank
    # gets as many batches, so no rank waits in an all-reduce that the others never join.
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=cfg.seed, drop_last=True)
    micro_batch = cfg.batch_size // (world_size * cfg.grad_accum)
    loader = make_loader(cfg, dataset, sampler, micro_batch, pin_memory)
    # A resume starts mid-epoch, at exactly the batch the interrupted run would have read next.
    first_epoch, skip = divmod(start_step * cfg.grad_accum, sampler.num_samples // micro_batch)
    for epoch in itertools.count(first_epoch):
        sampler.set_epoch(epoch)  # a new shuffle; without it every epoch repeats one order
        sampler.start_index = skip * micro_batch if epoch == first_epoch else 0
        loader.generator.manual_seed(cfg.seed * 1_000_003 + epoch)  # see make_loader()
        yield from loader


# The point of the lab: wrap in DDP, accumulate without syncing, checkpoint from rank 0.
def apply_ddp(model, device, cfg):
    # Gradients are all-reduced in buckets of ~bucket_cap_mb, each launched as soon as its
    # gradients are ready, so communication overlaps the rest of backward. DDP also
    # broadcasts rank 0's parameters at construction, so every replica starts the same.
    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb)


def inspect_ddp(ddp_model, world_size):
    """What every rank should hold: a full replica, identical everywhere."""
    params = list(ddp_model.module.parameters())
    checksum = torch.stack([p.detach().double().sum() for p in params]).sum().reshape(1)
    gathered = [torch.zeros_like(checksum) for _ in range(world_size)]
    dist.all_gather(gathered, checksum)
    assert all(torch.equal(g, checksum) for g in gathered), "replicas differ after DDP init"


def gradient_sync(model, enabled):
    """The context the kit's train_step() enters around each micro-step. no_sync() on all but
    the last: gradients accumulate locally, and the last micro-step's backward all-reduces
    their sum once per optimizer step instead of once per micro-step."""
    return contextlib.nullcontext() if enabled else model.no_sync()


def save_checkpoint(cfg, ddp_model, optimizer, step, rank, world_size, device):
    """Every replica is the same, so rank 0 alone writes the model, atomically (a temp file,
    fsync, rename). Every rank's RNG state travels to it with a collective: all ranks call."""
    rng_states = [None] * world_size
    dist.all_gather_object(rng_states, rng_state(device))  # labkit: CPU and device generators
    if rank == 0:
        save_file_atomically(cfg, {"model": ddp_model.module.state_dict(),
                                   "optimizer": optimizer.state_dict(), "step": step,
                                   "world_size": world_size, "rng": rng_states}, step)
    dist.barrier()  # nobody races ahead while rank 0 is still writing


def load_checkpoint(cfg, model, optimizer, rank, device):
    path = latest_checkpoint(cfg.checkpoint_dir)
    if path is None:
        return 0
    # weights_only: never unpickle arbitrary code; map_location: never onto cuda:0 by accident.
    state = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    restore_rng_state(state["rng"][rank] if rank < len(state["rng"]) else state["rng"][0], device)
    if rank == 0:
        print(f"resumed from {path} at step {state['step']}", flush=True)
    return state["step"]


def train(cfg, rank, world_size, device):
    torch.manual_seed(cfg.seed)
    model = build_model(cfg).to(device)
    model.init_weights(cfg.seed)
    ddp_model = apply_ddp(model, device, cfg)
    inspect_ddp(ddp_model, world_size)
    # Built after the wrap, over the same parameter tensors DDP all-reduces into.
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    start_step = load_checkpoint(cfg, model, optimizer, rank, device)
    amp_dtype = compute_dtype(cfg, device.type)
    scaler = make_grad_scaler(amp_dtype, device)
    batches = micro_batches(cfg, rank, world_size, start_step, pin_memory=device.type == "cuda")
    announce(cfg, rank, world_size, device, start_step, precision_name(amp_dtype),
             f"{sum(p.numel() for p in model.parameters()):,} params")
    log = train_loop(
        cfg, rank, device, start_step, [optimizer],
        # DDP's hooks all-reduce the gradients, bucket by bucket, during each backward.
        lambda step: train_step(ddp_model, optimizer, scaler, batches, cfg, device, amp_dtype,
                                gradient_sync),
        lambda step: save_checkpoint(cfg, ddp_model, optimizer, step, rank, world_size, device),
        loss_divisor=world_size)
    return ddp_model, log, amp_dtype


def run(cfg, rank, world_size, device, wall_start):
    """Train, then report (and check parity). Every model, and DDP's reducer, lives and dies
    in here, before the process group goes."""
    ddp_model, log, amp_dtype = train(cfg, rank, world_size, device)
    finish_run(cfg, rank, world_size, device, log, amp_dtype, wall_start,
               full_state=ddp_model.module.state_dict,
               extra={"precision": precision_name(amp_dtype)})


def main(argv=None):
    cfg = parse_config(argv)  # bad flags end here: one line, exit 2, no process group yet
    wall_start = time.perf_counter()
    rank, world_size, device = init_distributed(cfg)
    try:
        run(cfg, rank, world_size, device, wall_start)
    finally:
        teardown_distributed()  # even after an error: a rank never leaves its group behind


if __name__ == "__main__":
    main()
