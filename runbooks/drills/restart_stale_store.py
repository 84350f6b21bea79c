"""Drill: after a torchrun restart, gloo workers read the dead attempt's addresses.

torchrun's c10d rendezvous keeps one TCP store for the whole job and the workers of every
restart attempt use it. Attempt 0 writes each rank's gloo address there; after rank 1 dies and
torchrun restarts both ranks, a restarted rank that looks up its peer before the peer has
re-registered gets the old address, and its connection is refused. To make that happen in most
runs (not all: some unfixed restarts still recover), the surviving rank of attempt 0 also dies without cleanup (as a SIGKILLed worker would),
and restarted rank 0 joins --late-s after rank 1. --fixed namespaces the store keys
by attempt, as the labs do, and the restart succeeds.

    torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29412 \\
        --rdzv-id drill --max-restarts 1 runbooks/drills/restart_stale_store.py [--fixed]
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="namespace store keys by attempt")
    parser.add_argument("--late-s", type=float, default=3.0,
                        help="how long restarted rank 0 waits before joining")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="process group timeout")
    args = parser.parse_args()
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        parser.exit(2, "restart_stale_store.py: error: run it under torchrun (see --help)\n")
    return args


def attempt_store(rank, world_size, timeout):
    """The same function as in every lab's setup region."""
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=hosts_store, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt{attempt}/", store)


def make_rank0_late(rank, attempt, late_s, timeout):
    """Rank 1 announces it is about to join; rank 0 joins late_s after that, so rank 1 is sure
    to look up rank 0's address before rank 0 has re-registered it. (On a busy machine a plain
    sleep is not enough: imports alone can take longer.) Uses its own key namespace."""
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                is_master=False, timeout=timeout)
    side = dist.PrefixStore(f"drill-sync/attempt{attempt}/", agent_store)
    if rank == 1:
        side.set("rank1_joining", "1")
    else:
        side.wait(["rank1_joining"])
        time.sleep(late_s)


def main():
    args = parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if attempt > 0:
        make_rank0_late(rank, attempt, args.late_s, timeout)
    if args.fixed:
        dist.init_process_group("gloo", store=attempt_store(rank, world_size, timeout),
                                rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)  # env://, the usual way
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"attempt {attempt} rank {rank}: all_reduce ok ({total.item():.0f})", flush=True)
    if attempt == 0 and rank == 1:
        print("rank 1 dies (attempt 0)", file=sys.stderr, flush=True)
        os._exit(13)
    if attempt == 0:
        try:
            dist.all_reduce(total)  # rank 0 waits here for the dead peer
        except RuntimeError:
            os._exit(1)  # and dies without cleanup too, as a SIGKILLed or aborted worker would
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
