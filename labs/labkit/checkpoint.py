"""Atomic checkpoints: a reader (a resume, another node) sees the previous complete set of
files or the new one, never a half-written one. Two forms: one torch.save file written by
rank 0 (the replicated labs), or a DCP directory that every rank writes its shards into."""

import functools
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

from labkit.faults import maybe_crash_mid_checkpoint

KEEP = 2  # checkpoints kept on disk; older ones are deleted after each save


def checkpoint_path(directory, step, suffix=""):
    return Path(directory) / f"step_{step:08d}{suffix}"


def complete_checkpoints(directory):
    """Complete checkpoints in `directory`, oldest first: step_N.pt files, and step_N DCP
    directories that hold .metadata (its coordinator writes it last). Never *.tmp: a
    checkpoint loses its .tmp only once it is complete."""
    if not directory or not Path(directory).is_dir():
        return []
    found = [p for p in Path(directory).glob("step_*")
             if p.suffix == ".pt" or (p.is_dir() and p.suffix != ".tmp"
                                      and (p / ".metadata").exists())]
    return sorted(found)


def latest_checkpoint(directory):
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def checkpoint_step(path):
    """The step a checkpoint was written after: step_00000012(.pt) -> 12."""
    return int(Path(path).name.split("_")[1].split(".")[0])


def write_json_atomic(path, payload):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


def checkpointed_batch_size(directory):
    """The global batch of the run whose checkpoints are in `directory`, or None."""
    record = Path(directory) / "run.json" if directory else None
    if record and record.exists() and latest_checkpoint(directory):
        return json.loads(record.read_text())["batch_size"]
    return None


def commit(cfg, tmp, final, step):
    """Rank 0: make the checkpoint at `tmp` (complete and fsynced) the one at `final`."""
    maybe_crash_mid_checkpoint(cfg, step)
    # What a resume at another world size must keep.
    write_json_atomic(Path(cfg.checkpoint_dir) / "run.json", {"batch_size": cfg.batch_size})
    if final.is_dir():
        shutil.rmtree(final)  # a rerun that saves the same step again
    os.replace(tmp, final)  # atomic rename, of a file or of a whole directory
    fd = os.open(final.parent, os.O_RDONLY)
    os.fsync(fd)  # make the rename itself durable
    os.close(fd)
    for old in complete_checkpoints(final.parent)[:-KEEP]:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def save_file_atomically(cfg, state, step):
    """Rank 0 only: torch.save into step_N.pt.tmp, fsync, then rename to step_N.pt."""
    final = checkpoint_path(cfg.checkpoint_dir, step, ".pt")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    commit(cfg, tmp, final, step)


def save_dcp_atomically(cfg, state, step, rank):
    """Every rank writes its shards of `state` into step_N.tmp; rank 0 renames it to step_N
    only after all ranks finished, so a crash mid-save leaves a .tmp that resume never looks
    at. A collective: every rank must call it."""
    final = checkpoint_path(cfg.checkpoint_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
        final.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()  # nobody writes into tmp while rank 0 may still be clearing it
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()  # every rank's files, and rank 0's .metadata, are on disk (fsynced by DCP)
    if rank == 0:
        commit(cfg, tmp, final, step)
    dist.barrier()  # nobody races ahead (or reads) while rank 0 is renaming


def rng_state(device):
    """This rank's random generators: the CPU one, and on CUDA its device's, which dropout and
    sampling on the GPU draw from (torch.get_rng_state() alone is the CPU generator). Both
    states are CPU byte tensors."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state, device):
    """The inverse of rng_state(). A checkpoint saved on CPU has no CUDA state: a GPU resume
    then keeps its device generator's seed."""
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def full_state_dict(model):
    """Every parameter in full, with the single-process model's names: rank 0 gets a plain
    CPU copy, the other ranks {}. A collective (it all-gathers each sharded parameter, over
    every mesh axis): every rank calls it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


# A sharded model and its optimizer through DCP, for the labs whose subject is not
# checkpointing (lab02 writes its own out, with the RNG state and the samples seen).
def save_sharded(cfg, model, optimizer, step, rank):
    # Every rank writes only its own shards (no gather to rank 0; labkit: tmp dir, then
    # rename); the file names record each shard's global offsets, so any other mesh shape can
    # load it. RNG state is not saved: nothing here draws random numbers after init, and the
    # data order is a function of step.
    model_state, optim_state = get_state_dict(model, optimizer)
    save_dcp_atomically(cfg, {"model": model_state, "optim": optim_state}, step, rank)


def load_sharded(cfg, model, optimizer, rank):
    """Resume a model of DTensors and its optimizer from the newest complete checkpoint, on
    any mesh shape. Returns the step it was saved at (0: none)."""
    path = latest_checkpoint(cfg.checkpoint_dir)
    if path is None:
        return 0
    # Resharding on load: each rank asks for the slices its own (dp, tp) placements cover, and
    # DCP reads them from whichever shard files hold them. The mesh may differ from the saver's.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    step = int(path.name.split("_")[1])
    if rank == 0:
        print(f"resumed from {path} at step {step}", flush=True)
    return step


def full_state_once(cfg, model, rank):
    """A getter of full_state_dict(model) that all-gathers at most once (it is a collective:
    every rank calls it), for --export now and --check-parity later. Writes --export if asked."""
    full_state = functools.cache(lambda: full_state_dict(model))
    if cfg.export:
        state = full_state()
        if rank == 0:
            export_consolidated(state, cfg.export)
    return full_state


def export_consolidated(state, path):
    """One torch.save file of plain tensors: `TinyLlama(...).load_state_dict(torch.load(path,
    weights_only=True))` works in a single process, with no torch.distributed at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
