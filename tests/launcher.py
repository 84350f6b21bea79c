"""Run labs and drills the way a learner does: under torchrun, as separate processes.

Every launch has a timeout, and a failure shows the full output of every rank, so a broken
test says which rank broke and how.

Two ways to start ranks:
- real torchrun (`torchrun_cmd`, `run`, `run_drill`): every drill, every launch expected to
  fail or that sets its own environment, and anything about torchrun itself (restarts, its
  exit codes, its store, signals);
- `forked_run`: a lab launch that must succeed forks its ranks from a server that imported
  torch once (tests/zygote.py), with the environment torchrun gives each rank. On this
  2-core machine a 4-rank lab01 run starts in 5 s instead of 24.
"""

import atexit
import concurrent.futures
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LABS = REPO / "labs"
PYTHON = sys.executable

sys.path.insert(0, str(REPO / "tools"))  # the root conftest.py does too; launcher may run alone
import verified  # noqa: E402  (tools/verified.py)


class LaunchError(AssertionError):
    pass


def load_script(path):
    """Import a standalone script (a lab, a drill) as a module; its main() stays behind
    `if __name__ == "__main__"`, so nothing runs."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed_script(name):
    """A console script of the environment running the tests (the active venv or conda env,
    wherever it lives), else whatever PATH finds."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    return str(candidate) if candidate.exists() else shutil.which(name) or str(candidate)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def quiet_env(extra=None):
    """Environment for child jobs: one OpenMP thread per rank (2 cores here), no torchrun
    banner about it, and the caller's additions."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(extra or {})
    return env


# What a drill must not inherit from the shell that runs the tests: a rank or address of its
# own, or a switch that changes what it prints (the drill tests set these themselves).
DRILL_ENV_DROPPED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                     "TORCH_DISTRIBUTED_DEBUG", "USE_LIBUV", "TORCHELASTIC_ERROR_FILE")


def drill_env(**changes):
    """Environment for a drill: one OpenMP thread per rank, nothing inherited from
    DRILL_ENV_DROPPED unless the caller sets it, and the caller's changes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **changes}
    for name in DRILL_ENV_DROPPED:
        if name not in changes:
            env.pop(name, None)
    return env


def process_tree(pid):
    """pid and every process below it, parents first, read from /proc (torchrun's workers
    run in sessions of their own: the agent's process group does not reach them)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process exited meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, queue = [], [pid]
    while queue:
        tree.append(queue.pop(0))
        queue += children.get(tree[-1], [])
    return tree


def stacks_of(pids, timeout=20):
    """Every Python process's stack (py-spy dump), so that a hang says where it hung."""
    dumps = []
    for pid in pids:
        try:
            out = subprocess.run([installed_script("py-spy"), "dump", "--pid", str(pid)],
                                 capture_output=True, text=True, timeout=timeout)
            dumps.append(f"--- py-spy dump --pid {pid} ---\n{out.stdout}{out.stderr}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            dumps.append(f"--- py-spy dump --pid {pid}: {exc} ---")
    return "\n".join(dumps)


def stop_tree(proc):
    """After a timeout: dump every process's stack, then kill them all, the workers that
    outlive the agent included. Returns the dumps."""
    tree = process_tree(proc.pid)
    dumps = stacks_of(tree)
    for pid in reversed(tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return dumps


def communicate_or_stop(cmd, timeout, stdout, stderr, **kwargs):
    """subprocess.run, except that a timeout stops the whole process tree (stop_tree) and
    returns (None, stdout, stderr, dumps) instead of raising."""
    with subprocess.Popen(cmd, stdout=stdout, stderr=stderr, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
            return proc.returncode, out, err, ""
        except subprocess.TimeoutExpired:
            dumps = stop_tree(proc)
            out, err = proc.communicate()
            return None, out, err, dumps


def run_drill(cmd, env=None, timeout=150):
    """One drill launch that is expected to fail: never raises, returns rc, output and wall
    time. An overrun becomes rc None (its tests fail, the others still run). Output goes to a
    file, not a pipe: a straggling grandchild (a DataLoader worker stuck in its sample) must
    not keep the launch "running" after torchrun has exited."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        rc, _, _, dumps = communicate_or_stop(list(map(str, cmd)), timeout, log,
                                              subprocess.STDOUT, env=env or drill_env(), cwd=REPO)
        log.seek(0)
        out = log.read() + (f"\nTIMED OUT after {timeout} s\n{dumps}" if rc is None else "")
    return {"rc": rc, "out": out, "wall_s": time.monotonic() - t0,
            "cmd": " ".join(map(str, cmd))}


def torchrun_cmd(script, nproc, args=(), rdzv="standalone", extra_torchrun=()):
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if rdzv == "standalone":
        cmd += ["--standalone"]
    else:  # static rendezvous on a fresh port, so parallel tests never collide
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    return cmd + [*extra_torchrun, str(script), *map(str, args)]


def run(cmd, timeout=180, env=None, check=True, cwd=None):
    """Run a command; on failure raise with everything it printed. On a timeout, stop its
    whole process tree and raise with what it printed and every process's stack."""
    rc, out, err, dumps = communicate_or_stop(cmd, timeout, subprocess.PIPE, subprocess.PIPE,
                                              text=True, env=quiet_env(env), cwd=cwd or REPO)
    if rc is None:
        raise LaunchError(f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n"
                          f"--- stdout ---\n{out}\n--- stderr ---\n{err}\n{dumps}")
    proc = subprocess.CompletedProcess(cmd, rc, out, err)
    if check and proc.returncode != 0:
        raise launch_failed(proc)
    return proc


def launch_failed(proc):
    """The error for a launch that exited non-zero: its command, code and every line printed."""
    cmd = proc.args if isinstance(proc.args, str) else " ".join(map(str, proc.args))
    return LaunchError(f"exit {proc.returncode}: {cmd}\n"
                       f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")


def run_all(commands, timeout=180, envs=None):
    """run(command, env=envs[i], check=False) for every command, as many at a time as there are
    cores, results in the given order. A one-process command (a refusal, a --plan) keeps one
    core busy importing torch, so side by side they take half the time, and each sees what it
    would see alone."""
    envs = envs or [None] * len(commands)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        return list(pool.map(lambda cmd, env: run(cmd, timeout=timeout, env=env, check=False),
                             commands, envs))


class Zygote:
    """The client of tests/zygote.py: one server per test session, started on first use, that
    has imported torch once and forks the ranks of each launch (see its docstring for what it
    keeps from torchrun and what it does not)."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="zygote-"))
        self.socket_path = str(self.folder / "socket")
        self.server = subprocess.Popen([PYTHON, str(REPO / "tests" / "zygote.py"), self.socket_path],
                                       stdout=subprocess.PIPE, env=quiet_env(), cwd=REPO, text=True)
        ready = self.server.stdout.readline().strip()
        if ready != "ready":
            raise LaunchError(f"the zygote server did not start (said {ready!r})")
        atexit.register(self.server.kill)

    def run(self, script, nproc, args, timeout, env, cwd):
        """What `torchrun --standalone --nproc-per-node nproc script ARGS` (nproc > 0) or
        `python script ARGS` (nproc == 0) gives, as a CompletedProcess."""
        out, err = (self.folder / f"{uuid.uuid4().hex}.{name}" for name in ("out", "err"))
        request = {"script": str(script), "nproc": nproc, "args": list(map(str, args)),
                   "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        cmd = [f"forked-torchrun --nproc-per-node {nproc}" if nproc else "forked-python",
               str(script), *map(str, args)]
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(timeout)  # every wait below, the server's first answer included
            conn.connect(self.socket_path)
            conn.sendall((json.dumps(request) + "\n").encode())
            replies = conn.makefile()
            try:
                launcher = json.loads(replies.readline())["pid"]
            except TimeoutError:
                raise LaunchError(f"the zygote server did not start {' '.join(cmd)} "
                                  f"within {timeout}s") from None
            try:
                rc = json.loads(replies.readline())["rc"]
            except TimeoutError:  # socket.timeout is TimeoutError since Python 3.10
                dumps = stacks_of(process_tree(launcher))
                os.killpg(launcher, signal.SIGKILL)
                raise LaunchError(f"timed out after {timeout}s: {' '.join(cmd)}\n"
                                  f"--- stdout ---\n{read_and_remove(out)}\n"
                                  f"--- stderr ---\n{read_and_remove(err)}\n{dumps}") from None
        return subprocess.CompletedProcess(cmd, rc, read_and_remove(out), read_and_remove(err))


def read_and_remove(path):
    text = path.read_text(errors="replace") if path.exists() else ""
    path.unlink(missing_ok=True)
    return text


_ZYGOTE = []


def forked_run(script, nproc, args=(), timeout=180, cwd=None):
    """A launch that must succeed, its ranks forked from the session's zygote server
    (tests/zygote.py): `torchrun --standalone --nproc-per-node nproc` for nproc > 0, plain
    `python` for 0. Same code, same environment variables, no fresh import of torch per rank.
    Raises with every line printed if it fails or overruns."""
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote())
    proc = _ZYGOTE[0].run(script, nproc, args, timeout, quiet_env(), cwd or REPO)
    if proc.returncode != 0:
        raise launch_failed(proc)
    return proc


def run_lab(lab, nproc, args=(), tmp_path=None, timeout=180, env=None, check=True):
    """Launch labs/<lab>.py under torchrun (or plain python when nproc == 0) and return
    (completed process, metrics dict or None).

    A launch that must succeed and sets no environment of its own (check=True, env=None) forks
    its ranks from the zygote server (forked_run): the same lab code under torchrun's
    environment, without a fresh import of torch per rank. Anything else starts real torchrun
    (or python)."""
    script = LABS / f"{lab}.py"
    metrics_path = Path(tmp_path) / f"{lab}-{nproc}-{free_port()}.json" if tmp_path else None
    args = [*args, *(["--metrics-out", metrics_path] if metrics_path else [])]
    if check and env is None:
        proc = forked_run(script, nproc, args, timeout)
    else:
        cmd = [PYTHON, str(script), *map(str, args)] if nproc == 0 else torchrun_cmd(script, nproc, args)
        proc = run(cmd, timeout=timeout, env=env, check=check)
    metrics = json.loads(metrics_path.read_text()) if metrics_path and metrics_path.exists() else None
    if proc.returncode == 0 and metrics:
        verified.record_lab_run(metrics, "the test suite")  # the lab pages' "verified on" stamp
    return proc, metrics


def refusal_lines(lab, args, world_size, timeout=120):
    """Start labs/<lab>.py as one process of a `world_size` job (WORLD_SIZE set, no torchrun):
    a layout it must refuse exits 2 before any process group starts. Returns stderr's lines."""
    proc = run([PYTHON, str(LABS / f"{lab}.py"), *map(str, args)],
               env={"WORLD_SIZE": str(world_size)}, check=False, timeout=timeout)
    assert proc.returncode == 2, proc.stderr
    return proc.stderr.strip().splitlines()


_SHARED_RUNS = {}


def shared_lab_run(lab, nproc, args=(), timeout=300):
    """run_lab, once per (lab, nproc, args) for the whole session: tests in different files
    that assert different things about the same run (a lab's docstring line, its parity
    figures) share one launch instead of paying for two. The metrics stay in a temporary
    folder that lives as long as the session."""
    key = (lab, nproc, tuple(map(str, args)))
    if key not in _SHARED_RUNS:
        folder = tempfile.mkdtemp(prefix=f"shared-{lab}-")
        _SHARED_RUNS[key] = run_lab(lab, nproc, args, folder, timeout=timeout)
    return _SHARED_RUNS[key]


def preempt_lab(lab, nproc, args, once_printed, timeout=180):
    """Start labs/<lab>.py under torchrun, wait until a stdout line starts with `once_printed`,
    then SIGTERM every worker (as a scheduler preempting the job does) and wait for the end.
    Returns (returncode, stdout, stderr)."""
    cmd = torchrun_cmd(LABS / f"{lab}.py", nproc, args)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=quiet_env())
    deadline = time.monotonic() + timeout
    for line in proc.stdout:  # wait until training is under way
        if line.startswith(once_printed) or time.monotonic() > deadline:
            break
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    for pid in workers.stdout.split():
        subprocess.run(["kill", "-TERM", pid])
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


# One interpreter prints every script's --help: each script runs as __main__ (runpy), with its
# own folder first on sys.path and the repository's modules it imported forgotten afterwards,
# as a fresh `python script --help` would. A fresh interpreter per script spent 2 to 4 s of
# CPU importing torch again for each of ~60 scripts; here torch is imported once.
_HELP_COLLECTOR = r"""
import contextlib, io, json, os, runpy, sys
repo = os.path.realpath(sys.argv[1])
installed = os.path.realpath(sys.prefix)  # a ./.venv lives inside the repository
texts = {}
for key in json.loads(sys.argv[2]):
    script, *words = key
    before = set(sys.modules)
    sys.argv, sys.path[0] = [script, *words, "--help"], os.path.dirname(script)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    except (SystemExit, Exception):  # a script without --help fails, as it would alone
        pass
    texts[" ".join(key)] = out.getvalue()
    for name in set(sys.modules) - before:
        path = getattr(sys.modules[name], "__file__", None) or ""
        path = os.path.realpath(path)
        if path.startswith(repo + os.sep) and not path.startswith(installed + os.sep):
            del sys.modules[name]
print(json.dumps(texts))
"""


def help_texts(commands, timeout=300):
    """{" ".join(command): what `python <script> [subcommand] --help` prints} for commands
    given as (script path, *subcommand words), all from one interpreter (see above)."""
    keys = sorted({tuple(map(str, c)) for c in commands})
    proc = run([PYTHON, "-c", _HELP_COLLECTOR, str(REPO), json.dumps(keys)], timeout=timeout)
    return json.loads(proc.stdout.splitlines()[-1])
