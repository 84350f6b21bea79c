"""Drill: a DataLoader worker that hangs, is killed, or dies of a bus error (runbooks
dataloader-worker-hangs and dataloader-worker-killed).

One process, no torchrun: the faults live between the main process and its workers.
    python runbooks/drills/dataloader_worker_fault.py --fault hang --timeout-s 0
        # hangs forever in next(): the symptom (stop it with Ctrl-C)
    python runbooks/drills/dataloader_worker_fault.py --fault hang --timeout-s 2
        # RuntimeError: DataLoader timed out after 2.0 seconds
    python runbooks/drills/dataloader_worker_fault.py --fault kill
        # RuntimeError: DataLoader worker (pid X) is killed by signal: Killed.
    python runbooks/drills/dataloader_worker_fault.py --fault sigbus
        # ERROR: Unexpected bus error encountered in worker. This might be caused by
        # insufficient shared memory (shm).
    python runbooks/drills/dataloader_worker_fault.py --fault segv
        # ERROR: Unexpected segmentation fault encountered in worker.
    python runbooks/drills/dataloader_worker_fault.py --fault exit
        # RuntimeError: DataLoader worker (pid(s) X) exited unexpectedly
    python runbooks/drills/dataloader_worker_fault.py --fault none   # healthy: all batches

The faults are injected: `hang` blocks forever on a lock nobody releases (a deadlock in a
worker, or a read from a dead NFS mount, looks the same from outside), `kill` sends SIGKILL as
the kernel OOM killer does, `sigbus` raises SIGBUS as touching a shared-memory page that
/dev/shm cannot back does, `segv` raises SIGSEGV as a crashing C extension does, and `exit`
calls os._exit as a C extension that exits would. The messages that follow are PyTorch's own.
Several faults in one run: --fault none hang kill sigbus segv exit (each prints one
"fault X: ..." line, the chained cause after "<-"; exit status 1 if any failed). Healthy:
    fault none: ok: 8 batches in 0.12 s
"""

import argparse
import os
import signal
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

FAULTS = ["none", "hang", "kill", "sigbus", "segv", "exit"]


class FaultyDataset(Dataset):
    """Sample `fault_index` triggers the fault inside whichever worker loads it."""

    def __init__(self, num_samples, fault, fault_index):
        self.num_samples, self.fault, self.fault_index = num_samples, fault, fault_index

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        if index == self.fault_index and get_worker_info() is not None:
            self.inject()
        time.sleep(0.005)  # a little I/O latency per sample
        return torch.full((8,), float(index))

    def inject(self):
        pid = os.getpid()
        if self.fault == "hang":
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # blocks forever, like a deadlock inherited through fork
        elif self.fault == "kill":
            os.kill(pid, signal.SIGKILL)
        elif self.fault == "sigbus":
            os.kill(pid, signal.SIGBUS)
        elif self.fault == "segv":
            os.kill(pid, signal.SIGSEGV)
        elif self.fault == "exit":
            os._exit(3)


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None):
    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--fault", choices=FAULTS, nargs="+", default=["hang"],
                   help="what goes wrong in a worker; several run one after another")
    p.add_argument("--timeout-s", type=float, default=5.0,
                   help="DataLoader(timeout=...): seconds next() may wait for one batch "
                        "(0: wait forever, the PyTorch default)")
    p.add_argument("--num-workers", type=int, default=2, help="worker processes")
    p.add_argument("--num-batches", type=int, default=8, help="batches in the epoch")
    p.add_argument("--fault-batch", type=int, default=3, help="the batch whose first sample faults")
    args = p.parse_args(argv)
    if args.timeout_s < 0:
        p.error(f"--timeout-s must be >= 0, got {args.timeout_s}")
    if args.num_workers < 1:
        p.error(f"--num-workers must be >= 1 (faults live in workers), got {args.num_workers}")
    if not 0 <= args.fault_batch < args.num_batches:
        p.error(f"--fault-batch must be in [0, --num-batches), got {args.fault_batch}")
    return args


def run_epoch(fault, args):
    """One epoch with the fault injected; re-raises the loader's error after timing it."""
    batch_size = 4
    dataset = FaultyDataset(args.num_batches * batch_size, fault, args.fault_batch * batch_size)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=args.num_workers,
                        timeout=args.timeout_s)
    t0 = time.perf_counter()
    count = 0
    try:
        for count, _ in enumerate(loader, start=1):
            pass
    except RuntimeError as exc:
        # What a training loop sees. A real job lets it propagate (torchrun then stops the
        # other ranks) instead of swallowing it; here we add when it happened.
        # The worker's own fate (signal, exit code) is in the chained cause.
        cause = exc.__cause__
        chained = f" <- {type(cause).__name__}: {cause}" if isinstance(cause, RuntimeError) else ""
        print(f"\nfault {fault}: failed after {time.perf_counter() - t0:.2f} s at batch {count}: "
              f"{type(exc).__name__}: {exc}{chained}", file=sys.stderr, flush=True)
        raise
    print(f"fault {fault}: ok: {count} batches in {time.perf_counter() - t0:.2f} s", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if len(args.fault) == 1:
        run_epoch(args.fault[0], args)  # the real traceback, as a training job would show it
        return
    failed = 0
    for fault in args.fault:  # several drills in one process (the tests use this)
        try:
            run_epoch(fault, args)
        except RuntimeError:
            failed += 1
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
