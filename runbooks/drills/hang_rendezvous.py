"""Drill: the job hangs at start-up, inside init_process_group (rendezvous).

Three cases, each a plain `python` process (no torchrun), so you see exactly what
init_process_group does and how long it waits:
  * --case never-fills: rank 0 of a world of 2, and rank 1 never comes. Rank 0 hosts the
    TCPStore and waits for clients: "Timed out after N seconds waiting for clients. 1/2 clients
    joined." (DistStoreError).
  * --case wrong-port: rank 1 of a world of 2, pointed at a port where nobody listens (a typo in
    MASTER_PORT, a firewall, the master not up yet). The store client retries, then: "The client
    socket has timed out after 4000ms while trying to connect to (127.0.0.1, PORT)."
    (DistNetworkError).
  * --case env: use the RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT that torchrun (or you) set.
In every case the wait is bounded by init_process_group(timeout=...): --timeout-s here, 30 min
by default on gloo, 10 min on NCCL. torchrun's own rendezvous has separate knobs (see the
runbook: --rdzv-conf join_timeout=... for c10d, timeout=... for static).

    python runbooks/drills/hang_rendezvous.py --case never-fills --timeout-s 4
    python runbooks/drills/hang_rendezvous.py --case wrong-port --timeout-s 4
Runbook: runbooks/startup-hang.md.
"""

import argparse
import datetime
import os
import socket
import sys
import time

import torch.distributed as dist


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["never-fills", "wrong-port", "env"], default="env",
                        help="which start-up failure to reproduce (env: use the environment)")
    parser.add_argument("--timeout-s", type=float, default=4.0, help="init_process_group timeout")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.exit(2, "hang_rendezvous.py: error: --timeout-s must be > 0\n")
    return args


def unused_port():
    """A port that was free a moment ago and that nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None):
    args = parse_args(argv)
    if args.case != "env":
        rank = "0" if args.case == "never-fills" else "1"
        os.environ.update(RANK=rank, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(unused_port()))
    print(f"rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')}: init_process_group "
          f"to {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}, "
          f"timeout {args.timeout_s:.0f} s", flush=True)
    t0 = time.monotonic()
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    except dist.DistError as exc:  # DistStoreError and DistNetworkError both derive from it
        # The C++ message ends with a long frame dump; the first line is what matters.
        first_line = str(exc).splitlines()[0]
        print(f"failed after {time.monotonic() - t0:.1f} s: {type(exc).__name__}: {first_line}",
              flush=True)
        sys.exit(1)
    print(f"rank {dist.get_rank()}: joined a world of {dist.get_world_size()} after "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
