"""Start N real processes from a notebook cell and collect what each one returns.

Notebook cells cannot hold the worker functions: every child imports them by module name, so
they live in small modules next to the lessons (e.g. `ddp_workers.py`). Each child joins a
gloo process group on 127.0.0.1 and the call returns the per-rank results, or raises (never
hangs) after `timeout_s`.

`run_script` starts a script's ranks the way `torchrun --standalone` does (its per-rank
environment variables), for lessons that launch a lab many times.

The children come from a fork server that has already imported torch. A fresh interpreter
spends 2 to 4 s of CPU importing torch, per rank and per cell, which on a 2-core laptop is
most of a small cell's time. The server imports it once, before any thread or process group
exists, so each fork starts with torch loaded and nothing unsafe to copy.
"""

import datetime
import gc
import json
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PRELOADED = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
              "torch.distributed.tensor.parallel", "torch.distributed.pipelining",
              "torch.distributed.checkpoint"]  # what the lessons' workers and the labs import


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


def _script_rank(rank, script, args, world_size, port, log_dir, env):
    """One rank of `torchrun --standalone`: torchrun's per-rank variables, stdout and stderr in
    files (line-buffered, so a killed rank keeps what it printed), then the script as
    __main__; its sys.exit code is the exit code. Unlike a fresh interpreter, atexit handlers
    do not run (multiprocessing ends the child with os._exit), and the rest of the environment
    is the fork server's, from when it started."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      ROLE_NAME="default", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), ROLE_WORLD_SIZE=str(world_size),
                      GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                      TORCHELASTIC_RUN_ID="lesson", OMP_NUM_THREADS="1", **env)
    torch.set_num_threads(1)  # torchrun sets OMP_NUM_THREADS=1; torch read it in the server
    for fd, name in ((1, "out"), (2, "err")):
        with open(Path(log_dir) / f"rank{rank}.{name}", "w") as file:
            os.dup2(file.fileno(), fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    sys.argv = [str(script), *map(str, args)]
    sys.path[0] = str(Path(script).parent)  # as `python script` would
    runpy.run_path(str(script), run_name="__main__")


def _outputs(log_dir, nproc):
    parts = []
    for rank in range(nproc):
        for name in ("out", "err"):
            path = Path(log_dir) / f"rank{rank}.{name}"
            if path.exists() and path.read_text().strip():
                parts.append(f"--- rank {rank} std{name}\n{path.read_text()}")
    return "\n".join(parts)


def run_script(script, nproc, args=(), timeout_s=600, env=None):
    """What `torchrun --standalone --nproc-per-node nproc script ARGS` does on one machine, with
    the ranks forked from the server above instead of fresh interpreters: about 10 s less per
    launch on a 2-core machine (torchrun and each rank import torch). Returns rank 0's stdout.
    A rank that fails stops the others and raises with every rank's output; nothing waits
    past timeout_s, and an interrupted call (Ctrl-C in the notebook) kills its ranks. `env`
    adds variables to each rank's environment (the server's is fixed when it starts)."""
    mp.set_forkserver_preload(_PRELOADED)
    with tempfile.TemporaryDirectory() as log_dir:
        context = mp.start_processes(
            _script_rank, args=(script, list(args), nproc, _free_port(), log_dir, env or {}),
            nprocs=nproc, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{Path(script).name} on {nproc} ranks did not finish "
                                       f"within {timeout_s:.0f} s\n{_outputs(log_dir, nproc)}")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise RuntimeError(f"{Path(script).name} {' '.join(map(str, args))}: {exc}\n"
                               f"{_outputs(log_dir, nproc)}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return (Path(log_dir) / "rank0.out").read_text()


def launch_lab(script, nproc, args, metrics_path, torchrun=False, timeout_s=600, env=None):
    """`torchrun --standalone --nproc-per-node nproc script ARGS --metrics-out metrics_path`:
    prints the lab's last line and returns its metrics. torchrun=True starts real torchrun, as
    you would. Otherwise the ranks fork from the server above (run_script), with torchrun's
    per-rank environment: on a 2-core machine a short lab run spends most of its time in
    torchrun and each rank importing torch, about 10 s a launch that the fork skips. `env`
    adds variables to each rank's environment."""
    args = [*map(str, args), "--metrics-out", str(metrics_path)]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), str(script), *args]
        out = subprocess.run(cmd, check=True, timeout=timeout_s, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}).stdout
    else:
        out = run_script(script, nproc, args, timeout_s=timeout_s, env=env)
    print(out.strip().splitlines()[-1])
    return json.loads(Path(metrics_path).read_text())
