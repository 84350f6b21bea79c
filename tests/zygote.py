"""A torchrun stand-in for the test suite: ranks forked from a process that imported torch once.

Why: on this course's 2-core CI machine a lab launch spent most of its time starting Python.
torchrun imports torch (2.3 s of CPU), then every rank imports torch, torch.distributed,
FSDP and DTensor again (3.5 to 5 s each), before the lab does anything. Here one server
imports them once; each launch forks a launcher, which forks one worker per rank. A worker
gets the environment torchrun gives a rank on one node (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...), sets sys.argv
and sys.path as `python lab.py ARGS` would, and runs the lab as __main__.

What stays with real torchrun: everything about torchrun itself (its exit codes and failure
report, restarts, the agent's store, signals to the agent) and every drill. tests/launcher.py
sends a launch here only when it expects success and passes no environment of its own; the
contract tests (test_lab_contracts.py) and the drills start real torchrun.

How a forked rank ends is not how a real one does: it runs the atexit handlers, then leaves
through os._exit, skipping the interpreter's shutdown (module teardown, the last garbage
collection), which is where the exit hangs of runbooks/exit-hang.md happen. So every lab also
runs once per suite under real torchrun, with a real interpreter exit: `make course`, in
tests/test_readme_commands.py, whose output may hold no line but the runner's.

Protocol (one Unix-socket connection per launch): the client sends one JSON line
{script, nproc, args, env, cwd, stdout, stderr}, where nproc 0 means one plain
`python script ARGS` (no torchrun variables); the server answers {"pid": launcher pid}
(the client kills that process group on a timeout), then {"rc": exit code} at the end, where
the code follows torchrun: 0 when every rank exits 0, else 1.
"""

import atexit
import io
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
import uuid

# What every lab imports. Importing here, before any thread or process group exists, is what
# makes a fork safe: the children copy no lock that a thread holds.
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401

TERMINATE_GRACE_S = 30  # torchrun's default: SIGTERM the other ranks, SIGKILL after 30 s


def worker(script, args, env, stdout_fd, stderr_fd):
    """One rank: the process `python script ARGS` would be, under torchrun's environment."""
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # sys.exit("message") prints it and exits 1, as python does
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # what an uncaught exception does to `python script`
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_env(base, rank, nproc, port):
    return {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
            "ROLE_RANK": str(rank), "ROLE_NAME": "default", "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


# launcher.free_port's twin: the server does not import tests/launcher.py, which puts tools/ on
# sys.path, and every rank would inherit that path where a lab run alone has none.
def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_ranks(pids):
    """Wait for every rank; the first failure stops the others, as torchrun does. Returns the
    exit codes by pid (a signal as its negative number)."""
    codes, failed_at = {}, None
    while len(codes) < len(pids):
        if failed_at is None:
            pid, status = os.wait()
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() - failed_at > TERMINATE_GRACE_S:
                    for other in set(pids) - set(codes):
                        os.kill(other, signal.SIGKILL)
                    pid, status = os.wait()
                else:
                    time.sleep(0.05)
                    continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and failed_at is None:
            failed_at = time.monotonic()
            for other in set(pids) - set(codes):
                os.kill(other, signal.SIGTERM)
    return codes


def launch(conn, request):
    """The launcher: its own process group (the client kills it whole on a timeout), one
    forked worker per rank, torchrun's exit code."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    conn.sendall((json.dumps({"pid": os.getpid()}) + "\n").encode())
    os.chdir(request["cwd"])
    stdout_fd = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    stderr_fd = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    port, nproc = free_port(), request["nproc"]
    base = {**request["env"], "TORCHELASTIC_RUN_ID": uuid.uuid4().hex}
    pids = []
    envs = [rank_env(base, rank, nproc, port) for rank in range(nproc)] or [request["env"]]
    for env in envs:  # nproc == 0: one plain `python script ARGS`, no torchrun variables
        pid = os.fork()
        if pid == 0:
            conn.close()
            worker(request["script"], request["args"], env, stdout_fd, stderr_fd)
        pids.append(pid)
    codes = wait_for_ranks(pids)
    failures = {rank: codes[pid] for rank, pid in enumerate(pids) if codes[pid] != 0}
    if failures:
        os.write(stderr_fd, f"zygote: ranks failed (rank: exit code): {failures}\n".encode())
    rc = codes[pids[0]] if nproc == 0 else int(bool(failures))  # python's code, torchrun's
    conn.sendall((json.dumps({"rc": rc}) + "\n").encode())
    os._exit(0)


def serve(path):
    assert threading.active_count() == 1, "a thread before fork: the workers could deadlock"
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launchers are reaped without a wait
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        request = json.loads(conn.makefile().readline())
        if os.fork() == 0:
            server.close()
            try:
                launch(conn, request)
            finally:
                os._exit(1)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
