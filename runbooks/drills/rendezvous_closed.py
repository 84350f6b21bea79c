"""Drill: RendezvousClosedError, a node's agent meets a c10d rendezvous that another agent closed.

Two torchrun agents ("node 0" and "node 1", one worker each) share one c10d rendezvous on
localhost (--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID); node 0
hosts the store. Node 1's worker raises, and node 1 was started with --max-restarts 0, so its
agent gives up; on its way out torchrun shuts the rendezvous down (launcher/api.py:
`spec.rdzv_handler.shutdown()`), which marks it closed in the store for good.
  * --case failed-peer: node 0 has --max-restarts 1, and its worker fails too (its peer is gone
    mid-collective). Its agent restarts and re-enters the rendezvous: RendezvousClosedError.
  * --case late-join: node 0's worker is busy on its own (not in a collective), so node 0 keeps
    running. Then a third agent ("node 2", a replacement node) joins with the same --rdzv-id:
    RendezvousClosedError at once. The drill then stops node 0.
--fixed: the documented fix, a fresh --rdzv-id for a relaunch of every node (nobody failing):
both nodes finish.

    python runbooks/drills/rendezvous_closed.py --case failed-peer
    python runbooks/drills/rendezvous_closed.py --case late-join
    python runbooks/drills/rendezvous_closed.py --case late-join --fixed
Runbook: runbooks/rendezvous-closed.md.
"""

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

DRILL = os.path.abspath(__file__)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["failed-peer", "late-join"], default="failed-peer",
                        help="who meets the closed rendezvous: a restarting survivor or a late node")
    parser.add_argument("--fixed", action="store_true",
                        help="relaunch every node with a fresh --rdzv-id (nobody fails)")
    parser.add_argument("--limit-s", type=float, default=60.0,
                        help="stop any agent that has not ended after this many seconds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fail", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--busy-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.limit_s <= 0:
        parser.exit(2, "rendezvous_closed.py: error: --limit-s must be > 0\n")
    return args


def worker(args):
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    print(f"rank {rank}: up on {os.environ.get('TORCHELASTIC_RUN_ID')}, attempt {attempt}",
          flush=True)
    dist.barrier()
    if args.fail:
        time.sleep(1.0)
        raise RuntimeError(f"rank {rank}: this node's worker fails (the drill)")
    time.sleep(args.busy_s)  # late-join: work that does not involve the other node
    dist.barrier()  # failed-peer: the survivor is here when its peer dies
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Node:
    """One torchrun agent, output to a temp file (printed, prefixed, when it ends)."""

    def __init__(self, name, port, run_id, max_restarts, is_host, worker_args, env):
        self.name = name
        self.cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"127.0.0.1:{port}", "--rdzv-id", run_id,
                    "--rdzv-conf", f"is_host={int(is_host)},join_timeout=30",
                    "--max-restarts", str(max_restarts), DRILL, "--worker", *worker_args]
        shown = " ".join(self.cmd).replace(sys.executable, "python")
        print(f"{name}: $ {shown.replace(DRILL, 'rendezvous_closed.py')}", flush=True)
        self.log = tempfile.TemporaryFile("w+", errors="replace")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        self.took = None

    def wait(self, limit_s):
        try:
            rc = self.proc.wait(timeout=max(0.1, limit_s - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            rc = self.stop()
        self.took = self.took or time.monotonic() - self.t0
        return rc

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the agent forwards it to its worker
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            print(f"{self.name}: stopped by the drill", flush=True)
        return self.proc.returncode

    def report(self):
        self.log.seek(0)
        for line in self.log.read().splitlines():
            print(f"[{self.name}] {line}", flush=True)
        print(f"{self.name}: exit {self.proc.returncode} after {self.took:.1f} s", flush=True)


def wait_for_text(node, text, limit_s):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and node.proc.poll() is None:
        node.log.seek(0)
        if text in node.log.read():
            return True
        time.sleep(0.2)
    return False


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    port = free_port()
    run_id = f"drill-{port}"  # unique per run; a real job uses the scheduler's job id
    if args.fixed:  # a relaunch of the whole job under a fresh id, nobody failing
        nodes = [Node("node 0", port, f"{run_id}-relaunch", 0, True, [], env),
                 Node("node 1", port, f"{run_id}-relaunch", 0, False, [], env)]
        rcs = [node.wait(args.limit_s) for node in nodes]
        for node in nodes:
            node.report()
        ok = rcs == [0, 0]
        print(f"rendezvous_closed: {args.case} --fixed: {'OK' if ok else 'FAILED'}", flush=True)
        sys.exit(0 if ok else 1)
    busy = ["--busy-s", str(args.limit_s)] if args.case == "late-join" else []
    node0 = Node("node 0", port, run_id, 1 if args.case == "failed-peer" else 0, True, busy, env)
    node1 = Node("node 1", port, run_id, 0, False, ["--fail"], env)
    nodes = [node0, node1]
    node1.wait(args.limit_s)
    if args.case == "late-join":
        # Node 1 has exited (and closed the rendezvous); node 0 still runs and hosts the store.
        late = Node("node 2", port, run_id, 0, False, [], env)
        nodes.append(late)
        late.wait(args.limit_s)
        node0.stop()
    node0.wait(args.limit_s)
    for node in nodes:
        node.report()
    who = nodes[-1] if args.case == "late-join" else node0
    who.log.seek(0)
    closed = "RendezvousClosedError" in who.log.read()
    print(f"rendezvous_closed: {args.case}: {who.name} "
          f"{'got RendezvousClosedError' if closed else 'did NOT get RendezvousClosedError'} "
          f"after {who.took:.1f} s", flush=True)
    sys.exit(1 if closed else 0)


if __name__ == "__main__":
    main()
