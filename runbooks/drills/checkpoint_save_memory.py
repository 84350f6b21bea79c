"""Drill: what saving an FSDP2 checkpoint costs each rank, and the save that times the job out.

Symptom reproduced: a job that trains fine runs out of (host or device) memory, or times out,
while it saves a checkpoint (pytorch/pytorch#137151). Each run builds an FSDP2 MLP (every
Linear sharded on dim 0 over all ranks), saves it, and prints every rank's peak extra resident
memory (RSS) during the save next to the model's bytes:
  --how full          get_model_state_dict(full_state_dict=True): every rank all-gathers
                      every parameter and keeps the full copy: each rank ~ the whole model
  --how full-offload  the same with cpu_offload=True: only rank 0 keeps it (on the CPU), the
                      others drop each gathered tensor: rank 0 ~ the whole model
  --how dcp           dcp.save of the sharded state dict: each rank writes its own shards,
                      nothing is gathered: each rank adds at most its shard (model / world)
  --how dcp-async     dcp.async_save: stages a CPU copy of the shards (~ model / world per
                      rank), returns, and writes from a background thread
--how also takes a comma-separated list, measured one after another in the same processes.
Full state dicts are written by rank 0 with torch.save into `<name>.tmp`, fsynced, then
renamed; DCP writes into `<dir>.tmp`, renamed by rank 0 once every rank is done: a crash never
leaves a half-written checkpoint under the name a resume would load.

--slow-rank0-save: rank 0 writes a full checkpoint alone to storage that takes --save-s
seconds, while the other ranks go on to the next step's all_reduce, which gives up after
--timeout-s. The fixes (--fix): `barrier` makes every rank wait for rank 0 in a barrier on a
gloo side group created with a long timeout (--barrier-timeout-s); `dcp` saves collectively
(every rank writes its shard, to the same slow storage, in parallel, so nobody waits alone).

Run (CPU, gloo, 2 ranks; on GPUs the same calls are GPU only, not executed in CI):
    torchrun --standalone --nproc-per-node 2 runbooks/drills/checkpoint_save_memory.py \\
        --how full,full-offload,dcp,dcp-async
    torchrun --standalone --nproc-per-node 2 runbooks/drills/checkpoint_save_memory.py \\
        --slow-rank0-save --timeout-s 3 --save-s 6
    torchrun --standalone --nproc-per-node 2 runbooks/drills/checkpoint_save_memory.py \\
        --slow-rank0-save --timeout-s 3 --save-s 6 --fix barrier
Runbook: runbooks/checkpoint-save-oom.md. Lab: labs/lab02_fsdp.py (`save_checkpoint()`).
"""

import argparse
import ctypes
import datetime
import gc
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

MiB = 2**20
HOWS = ["full", "full-offload", "dcp", "dcp-async"]


def how_list(text):
    hows = text.split(",")
    for how in hows:
        if how not in HOWS:
            raise argparse.ArgumentTypeError(f"{how!r} is not one of {', '.join(HOWS)}")
    return hows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--how", type=how_list, default=["full-offload"],
                        help=f"how the checkpoint is taken ({', '.join(HOWS)}), or a "
                             "comma-separated list measured one after another")
    parser.add_argument("--hidden", type=int, default=1024, help="width of each Linear")
    parser.add_argument("--layers", type=int, default=16,
                        help="Linear layers (default 16 x 1024 x 1024 fp32: 64 MiB)")
    parser.add_argument("--dir", default="", help="where to write (default: a temp dir)")
    parser.add_argument("--slow-rank0-save", action="store_true",
                        help="rank 0 saves a full checkpoint alone on slow storage while the "
                             "others go on to the next collective")
    parser.add_argument("--save-s", type=float, default=6.0,
                        help="--slow-rank0-save: seconds the storage takes for the whole model")
    parser.add_argument("--fix", choices=["none", "barrier", "dcp"], default="none",
                        help="--slow-rank0-save: none, a long-timeout gloo side-group barrier, "
                             "or a collective DCP save")
    parser.add_argument("--timeout-s", type=float, default=30.0,
                        help="init_process_group timeout (how long a rank waits in a collective)")
    parser.add_argument("--barrier-timeout-s", type=float, default=120.0,
                        help="--fix barrier: timeout of the side group's barrier")
    args = parser.parse_args(argv)
    if min(args.hidden, args.layers) < 1 or min(args.timeout_s, args.barrier_timeout_s) <= 0 \
            or args.save_s < 0:
        parser.exit(2, "checkpoint_save_memory.py: error: --hidden and --layers must be >= 1, "
                       "timeouts > 0, --save-s >= 0\n")
    if args.fix != "none" and not args.slow_rank0_save:
        parser.exit(2, "checkpoint_save_memory.py: error: --fix needs --slow-rank0-save\n")
    return args


def use_mmap_for_large_allocations():
    """Pin glibc's mmap threshold at 128 KiB. By default it rises after the first big free, and
    later big tensors then reuse heap pages that are already resident: RSS under-counts them
    (with this call removed, a full save measured after another one showed 0.28 x model, not
    1.0 x). Pinned, every tensor over 128 KiB is its own mapping, returned to the OS on free."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_MMAP_THRESHOLD = -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024))


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident memory above the value at entry, sampled every millisecond by a thread
    (what the OOM killer sees: tensors, pickling buffers and file-write buffers alike)."""

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.extra = self.peak - self.base


def build_model(args, device):
    # Meta device, shard, then materialise: no rank ever holds the whole model before saving.
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0, 0.02)
    return model


def model_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())  # global shapes


def shard_bytes(model):
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def slow_storage(seconds):
    """Stand-in for a slow filesystem (NFS, object store): the write takes `seconds`."""
    time.sleep(seconds)


def write_atomically(state, path, storage_s=0.0):
    """torch.save into path.tmp, fsync, then rename: a reader (a resume) sees the previous
    file or the whole new one, and a crash leaves only path.tmp behind (lab01 does the same)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        slow_storage(storage_s)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_full(model, path, rank, offload, storage_s=0.0):
    """A collective (every rank all-gathers every parameter), then rank 0 writes one file."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
    state = get_model_state_dict(model, options=options)
    if rank == 0:
        write_atomically(state, path, storage_s)
    return sum(t.numel() * t.element_size() for t in state.values())


def save_dcp(model, path, rank, storage_s=0.0):
    """A collective: every rank writes its own shards into path.tmp; rank 0 renames it once
    every rank is done (lab02's save_checkpoint() does the same, plus an fsync)."""
    tmp = path.with_name(path.name + ".tmp")
    state = get_model_state_dict(model)  # sharded: DTensors, nothing gathered
    dcp.save(state, checkpoint_id=tmp)
    slow_storage(storage_s)
    dist.barrier()
    if rank == 0:
        os.replace(tmp, path)
    return sum(t.to_local().numel() * t.element_size() for t in state.values())


def save_dcp_async(model, path, rank):
    """dcp.async_save: stage a CPU copy of the shards, then write it from a background thread
    while training goes on; wait for the write before the rename."""
    tmp = path.with_name(path.name + ".tmp")
    t0 = time.monotonic()
    response = dcp.async_save(get_model_state_dict(model), checkpoint_id=tmp)
    blocked = time.monotonic() - t0
    future = getattr(response, "upload_completion", response)  # a Future, or a response object
    future.result()
    print(f"rank {rank}: async_save returned after {blocked:.2f} s, the write finished after "
          f"{time.monotonic() - t0:.2f} s", flush=True)
    dist.barrier()
    if rank == 0:
        os.replace(tmp, path)
    return shard_bytes(model)


def measure(how, model, rank, directory):
    target = Path(directory) / f"model_{how}"  # one file (full) or one directory (dcp)
    gc.collect()  # the previous --how's state dict is gone before this one is measured
    dist.barrier()
    with PeakRSS() as peak:
        if how == "dcp":
            held = save_dcp(model, target, rank)
        elif how == "dcp-async":
            held = save_dcp_async(model, target, rank)
        else:
            held = save_full(model, target, rank, offload=how == "full-offload")
    total = model_bytes(model)
    print(f"rank {rank}: how {how} | model {total / MiB:.1f} MiB | shard "
          f"{shard_bytes(model) / MiB:.1f} MiB | state dict held {held / MiB:.1f} MiB | "
          f"peak extra RSS {peak.extra / MiB:.1f} MiB ({peak.extra / total:.2f} x model)",
          flush=True)


def slow_rank0_save(args, model, rank, world_size, directory):
    """Step 1 trains, rank 0 checkpoints alone (or everybody, with --fix dcp), step 2's
    all_reduce is the next collective."""
    grad = torch.ones(1024)
    side = None
    if args.fix == "barrier":
        # A second group, gloo, with its own long timeout: new_group() does NOT inherit the
        # default group's timeout (runbooks/collective-timeout.md, cause D), so pass it.
        side = dist.new_group(backend="gloo",
                              timeout=datetime.timedelta(seconds=args.barrier_timeout_s))
    dist.all_reduce(grad)
    print(f"rank {rank}: step 1 ok", flush=True)
    t0 = time.monotonic()
    if args.fix == "dcp":
        save_dcp(model, Path(directory) / "step_1", rank, storage_s=args.save_s / world_size)
    else:
        # The bug: a full save that only rank 0 performs, written to slow storage. (Rank 0
        # still gathers with everyone; the gather is fast, the write is what takes long.)
        save_full(model, Path(directory) / "step_1.pt", rank, offload=True,
                  storage_s=args.save_s)
        if side is not None:
            dist.barrier(group=side)  # everyone waits here for rank 0, up to the long timeout
    print(f"rank {rank}: past the checkpoint of step 1 after {time.monotonic() - t0:.1f} s",
          flush=True)
    t1 = time.monotonic()
    try:
        dist.all_reduce(grad)
    except RuntimeError as exc:
        print(f"rank {rank}: step 2 all_reduce failed after {time.monotonic() - t1:.1f} s: "
              f"{exc}", flush=True)
        return False
    print(f"rank {rank}: step 2 ok", flush=True)
    return True


def run(args, rank, world_size, directory):
    """Build the sharded model and run the drill; the model is freed when this returns."""
    model = build_model(args, torch.device("cpu"))
    if args.slow_rank0_save:
        return slow_rank0_save(args, model, rank, world_size, directory)
    for how in args.how:
        measure(how, model, rank, directory)
    return True


def main(argv=None):
    args = parse_args(argv)
    mmap_fixed = use_mmap_for_large_allocations()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    made_dir = not args.dir
    if rank == 0 and args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    shared = [args.dir or (tempfile.mkdtemp(prefix="ckpt_drill_") if rank == 0 else "")]
    dist.broadcast_object_list(shared, src=0)  # one directory for all ranks: rank 0's
    directory = shared[0]
    if rank == 0:
        print(f"torch {torch.__version__} | world {world_size} | mmap threshold pinned "
              f"{mmap_fixed} | writing to {directory}", flush=True)
    if args.slow_rank0_save and rank == 0:
        def on_sigterm(signum, frame):  # torchrun stops the survivors once a rank has failed
            left = sorted(p.name for p in Path(directory).iterdir())
            print(f"rank 0: stopped by SIGTERM while saving; {directory} holds {left}",
                  flush=True)
            if made_dir:
                shutil.rmtree(directory, ignore_errors=True)
            os._exit(143)
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        ok = run(args, rank, world_size, directory)
    finally:
        if rank == 0 and made_dir:
            shutil.rmtree(directory, ignore_errors=True)
    if not ok:
        sys.stdout.flush()
        os._exit(1)  # the default group is broken after a timeout: leave without tearing down
    # The model lived only inside run(); collect its cycles so no sharded parameter keeps the
    # group alive past its destruction (runbooks/exit-hang.md, cause D: an abort at exit).
    gc.collect()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
