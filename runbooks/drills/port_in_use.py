"""Drill: the master port or the rendezvous endpoint is already taken (EADDRINUSE).

The drill first makes a port busy (--holder socket: a plain listening socket, as a leftover
process or another service would; --holder job: another torchrun job on that port), shows the
holder the way `ss -ltnp` does, then launches a 2-rank job on that port and reports how it ended:
  * --case static: `torchrun --master-port P` (the static rendezvous): torchrun's agent cannot
    host its TCPStore, "The server socket has failed to listen on any local network address.
    ... EADDRINUSE" (DistNetworkError) within a second.
  * --case env: no torchrun, one rank calls init_process_group("gloo") with MASTER_PORT=P (the
    mp.spawn / hand-launched pattern): the same DistNetworkError, from init_process_group.
  * --case c10d: `torchrun --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P`: the agent silently
    falls back to being a store client (c10d_rendezvous_backend.py, _create_tcp_store) and talks
    to whatever holds P. A plain socket never answers, so the job hangs without a message (the
    drill stops it after --hang-s). Another job's store answers, and this job then shares it
    until that job ends (--holder job).
  * --case port-zero: `torchrun --master-port 0`: accepted, the agent's store gets a free port,
    but the workers are told port 0 and time out connecting to (127.0.0.1, 0).
--fix free-port launches on a port nobody holds; --fix standalone uses `torchrun --standalone`.

    python runbooks/drills/port_in_use.py --case static
    python runbooks/drills/port_in_use.py --case static --holder job
    python runbooks/drills/port_in_use.py --case c10d --hang-s 10
    python runbooks/drills/port_in_use.py --case static --fix standalone
Runbook: runbooks/address-in-use.md.
"""

import argparse
import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

DRILL = os.path.abspath(__file__)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["static", "env", "c10d", "port-zero"],
                        default="static", help="how the job is pointed at the busy port")
    parser.add_argument("--holder", choices=["socket", "job"], default="socket",
                        help="what holds the port: a plain listening socket or another torchrun job")
    parser.add_argument("--fix", choices=["none", "free-port", "standalone"], default="none",
                        help="launch on a port nobody holds, or with torchrun --standalone")
    parser.add_argument("--port", type=int, default=0, help="the port to make busy (0: any free)")
    parser.add_argument("--hang-s", type=float, default=60.0,
                        help="stop a launch that has not ended after this many seconds")
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="init_process_group timeout of the workers")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hold-s", type=float, default=0.0, help=argparse.SUPPRESS)
    # The c10d --holder job handshake: job B's rank 0 creates the flag once it has joined, and
    # job A holds until then (at most --hold-s), so that job A ends while job B still runs
    # however slowly a loaded machine starts job B.
    parser.add_argument("--joined-flag", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hold-until", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hang_s <= 0 or args.timeout_s <= 0 or not 0 <= args.port < 65536:
        parser.exit(2, "port_in_use.py: error: --hang-s, --timeout-s > 0, 0 <= --port < 65536\n")
    if args.fix == "standalone" and args.case not in ("static", "c10d"):
        parser.exit(2, "port_in_use.py: error: --fix standalone is a torchrun flag: use it with "
                       "--case static or c10d\n")
    return args


def worker(args):
    """What each rank runs: join the group, optionally stay a while (a running job), finish."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    print(f"rank {rank}: joined via {os.environ.get('MASTER_ADDR')}:"
          f"{os.environ.get('MASTER_PORT')} (job {os.environ.get('TORCHELASTIC_RUN_ID')})",
          flush=True)
    if rank == 0 and args.joined_flag:
        open(args.joined_flag, "w").close()
    hold_for(args.hold_s, args.hold_until)
    dist.barrier()
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()


def hold_for(hold_s, until_path):
    """Stay up hold_s seconds, or less once until_path exists."""
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline:
        if until_path and os.path.exists(until_path):
            return
        time.sleep(0.1)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_busy(port):
    """True if something already listens on the port (our own bind attempt fails)."""
    with socket.socket(socket.AF_INET6) as sock:
        try:
            sock.bind(("::", port))
        except OSError:
            return True
    return False


def show_holder(port):
    """What `ss -ltnp 'sport = :PORT'` says (the first thing to run on a real node)."""
    if shutil.which("ss") is None:
        print("ss not found (package iproute2); try: lsof -iTCP:PORT -sTCP:LISTEN", flush=True)
        return
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True,
                         timeout=10).stdout.strip()
    print(f"$ ss -ltnp 'sport = :{port}'\n{out or '(nothing listens)'}", flush=True)


def launch_cmd(case, port, fix, hold_s, timeout_s, run_id, flag_args=()):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    script = [DRILL, "--worker", "--hold-s", str(hold_s), "--timeout-s", str(timeout_s),
              *flag_args]
    if fix == "standalone":
        return [*torchrun, "--standalone", *script]
    if case in ("static", "port-zero"):
        return [*torchrun, "--master-addr", "127.0.0.1", "--master-port",
                "0" if case == "port-zero" else str(port), *script]
    if case == "c10d":
        return [*torchrun, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", run_id, *script]
    return [sys.executable, DRILL, "--worker", "--timeout-s", str(timeout_s)]  # env: rank 0 only


def run_bounded(cmd, env, hang_s):
    """Run a launch with its output streaming through; stop it after hang_s. (rc, seconds)."""
    shown = " ".join(cmd).replace(sys.executable, "python").replace(DRILL, "port_in_use.py")
    if "RANK" in env:
        shown = f"RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT={env['MASTER_PORT']} {shown}"
    print("$ " + shown, flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=hang_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        rc = None
    return rc, time.monotonic() - t0


def start_holder(args, port, env, joined_flag):
    """Make the port busy; returns (holder object, description)."""
    if args.holder == "socket":
        sock = socket.socket(socket.AF_INET6)
        sock.bind(("::", port))  # dual stack: IPv4 and IPv6, like the TCPStore server
        sock.listen()
        return sock, f"a plain listening socket (pid {os.getpid()}, this drill)"
    # Another torchrun job on the same port. With c10d it ends once ours has joined (ours
    # shares its store, and is still running); with static it outlives our failed start.
    c10d = args.case == "c10d"
    hold_s = 60.0 if c10d else args.hang_s + 10
    cmd = launch_cmd("c10d" if c10d else "static", port, "none", hold_s, args.timeout_s,
                     "job-A", ("--hold-until", joined_flag) if c10d else ())
    print("job A, the one that got the port first:", flush=True)
    print("$ " + " ".join(cmd).replace(sys.executable, "python").replace(DRILL, "port_in_use.py"),
          flush=True)
    log = tempfile.TemporaryFile("w+", errors="replace")  # its output is summed up at the end
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc.log = log
    deadline = time.monotonic() + 60
    while not port_busy(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"port_in_use.py: job A did not start listening on {port}")
        time.sleep(0.2)
    return proc, f"torchrun job A (pid {proc.pid})"


def stop_holder(holder, grace_s):
    """Release the port. A holder job gets grace_s to end by itself first: job B's failure can
    be job A's own shutdown (its store going away), seen before job A's agent has exited."""
    if isinstance(holder, socket.socket):
        holder.close()
        return
    try:
        holder.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    stopped = holder.poll() is None
    if stopped:
        os.killpg(holder.pid, signal.SIGTERM)  # torchrun forwards it to its workers
    rc = holder.wait(timeout=60)
    holder.log.seek(0)
    for line in holder.log.read().splitlines():
        if line.startswith("rank "):
            print(f"[job A] {line}", flush=True)
    print(f"[job A] {'stopped by the drill' if stopped else 'ended by itself'}, exit {rc}",
          flush=True)
    holder.log.close()


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    port = args.port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if args.case == "env":
        env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    joined_flag = os.path.join(tempfile.mkdtemp(prefix="port_in_use_"), "job-B-joined")
    holder, what = start_holder(args, port, env, joined_flag)
    try:
        print(f"port {port} is held by {what}", flush=True)
        show_holder(port)
        target = free_port() if args.fix == "free-port" else port
        if args.case == "env" and args.fix == "free-port":
            env["MASTER_PORT"] = str(target)
        # Sharing job A's c10d store: stay up longer than job A, to see what happens when it ends.
        shares = args.case == "c10d" and args.holder == "job" and args.fix == "none"
        cmd = launch_cmd(args.case, target, args.fix, 60.0 if shares else 0.0, args.timeout_s,
                         "job-B", ("--joined-flag", joined_flag))
        print(f"job B, --case {args.case} --fix {args.fix}:", flush=True)
        rc, took = run_bounded(cmd, env, args.hang_s)
    finally:
        # job A (c10d) ends by itself once job B has joined; the static holder never does.
        stop_holder(holder, grace_s=30.0 if args.case == "c10d" else 0.0)
        shutil.rmtree(os.path.dirname(joined_flag), ignore_errors=True)
    if rc is None:
        print(f"port_in_use: {args.case}: HUNG, no result after {took:.1f} s (stopped)", flush=True)
        sys.exit(3)
    verdict = "OK" if rc == 0 else "FAILED"
    print(f"port_in_use: {args.case}: {verdict}, exit {rc} after {took:.1f} s", flush=True)
    sys.exit(0 if rc == 0 else 1)


if __name__ == "__main__":
    main()
