"""Start N real processes from a notebook cell and collect what each one returns.

Notebook cells cannot hold the worker functions: every child imports them by module name, so
they live in small modules next to the lessons (e.g. `ddp_workers.py`). Each child joins a
gloo process group on 127.0.0.1 and the call returns the per-rank results, or raises (never
hangs) after `timeout_s`.

The children come from a fork server that has already imported torch. A fresh interpreter
spends 2 to 4 s of CPU importing torch, per rank and per cell, which on a 2-core laptop is
most of a small cell's time. The server imports it once, before any thread or process group
exists, so each fork starts with torch loaded and nothing unsafe to copy.
"""

import datetime
import gc
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PRELOADED = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor"]


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank, fn, world_size, port, out_dir, timeout_s, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # N processes share this machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        torch.save(fn(rank, world_size, *args), Path(out_dir) / f"rank{rank}.pt")
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # free fn's models before the group goes
        raise
    finally:
        # A DDP model freed after destroy_process_group() takes the gloo group down while
        # holding the GIL and can hang or abort the process (runbooks/exit-hang.md): collect
        # any model kept alive by a reference cycle while the group is still registered.
        gc.collect()
        dist.destroy_process_group()


def run_workers(fn, world_size, *args, timeout_s=60, startup_s=120):
    """Run fn(rank, world_size, *args) in world_size processes; return [result of rank 0, ...].

    timeout_s bounds every collective (the process group timeout); startup_s is the extra time
    allowed for starting Python and importing torch in each child, generous because a loaded
    2-core machine can take a minute for that alone. Results travel back through torch.save
    files, so tensors, numbers and dicts all work.
    """
    mp.set_forkserver_preload(_PRELOADED)  # read when the server starts: the first call
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _child, args=(fn, world_size, _free_port(), out_dir, timeout_s, args),
            nprocs=world_size, join=False, start_method="forkserver")
        limit_s = timeout_s + startup_s
        deadline = time.monotonic() + limit_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} processes did not finish "
                                   f"within {limit_s:.0f}s")
        # weights_only=False is safe only because these files were just written by our own
        # children in a private temp dir; never load untrusted files this way.
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]
