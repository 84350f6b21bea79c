"""Drill: errors raised inside DataLoader workers, and the shared-memory limits of their batches.

Runbooks: dataloader-worker-error (getitem, collate, omp-fork) and dataloader-shared-memory
(fd-limit, shm-full and their -feeder variants).

One process, no torchrun. Every run is bounded: DataLoader(timeout=--timeout-s), small epochs.
    python runbooks/drills/dataloader_errors.py --case getitem
        # KeyError: Caught KeyError in DataLoader worker process 1.
        # Original Traceback (most recent call last): ... in __getitem__ ... KeyError: 'label'
    python runbooks/drills/dataloader_errors.py --case collate
        # RuntimeError: Caught RuntimeError in DataLoader worker process 0.
        # Original Traceback (most recent call last): ... stack expects each tensor to be equal size
    python runbooks/drills/dataloader_errors.py --case collate --num-workers 0
        # the same error without the wrapper: the traceback ends in your own code
    python runbooks/drills/dataloader_errors.py --case fd-limit
        # RuntimeError: Too many open files. Communication with the workers is no longer possible.
    python runbooks/drills/dataloader_errors.py --case fd-limit-feeder
        # a worker runs out of descriptors first: it prints "unable to open shared memory object
        # ... Too many open files (24)" and the loader waits until its timeout
    python runbooks/drills/dataloader_errors.py --case shm-full
        # RuntimeError: Caught RuntimeError in DataLoader worker process N. ...
        # unable to allocate shared memory(shm) for file </torch_...>: No space left on device (28)
    python runbooks/drills/dataloader_errors.py --case shm-full-feeder
        # the same allocation failure, printed by the worker; the loader waits until its timeout
    python runbooks/drills/dataloader_errors.py --case omp-fork
        # a worker deadlocks in an OpenMP thread pool inherited through fork:
        # RuntimeError: DataLoader timed out after 5.0 seconds
    python runbooks/drills/dataloader_errors.py --case getitem collate fd-limit --fix all
    python runbooks/drills/dataloader_errors.py --case shm-full omp-fork --fix all
        # every documented fix of each case, one "ok" line each

Add `--fix` to apply each case's first documented fix, `--fix NAME ...` for named ones, or
`--fix all` for every one (see FIXES). `--case shm-full --fix file-system` shows advice that
does not help (NOT_FIXES): it still fails. Each run prints one line, "case X: failed after S s at
batch B: ..." or "case X --fix F: ok: N batches in S s"; exit status 1 if any run failed.

How each case is made (the messages that follow are PyTorch's own):
- getitem: one record of the dataset lacks a field; __getitem__ raises KeyError in a worker.
- collate: samples of different lengths, and the default collate_fn stacks them.
- fd-limit: the soft RLIMIT_NOFILE is lowered to --fd-limit (what `ulimit -n 128` does); each
  batch is a list of small tensors and the loop keeps every batch, as an evaluation loop that
  collects outputs does. With the default "file_descriptor" sharing strategy every shared
  tensor costs the training process one open descriptor for as long as it lives.
- fd-limit-feeder: the same limit, but each batch holds so many tensors that a worker runs out
  first, while its queue's feeder thread pickles the batch.
- shm-full, shm-full-feeder: the drill re-runs itself under `unshare --mount --propagation
  private` (needs root or CAP_SYS_ADMIN) and mounts a --shm-size tmpfs over /dev/shm in that
  private mount namespace, as a container runtime does (Docker's default is 64m). The host's
  /dev/shm is never touched. shm-full-feeder skips the collate stacking, so the allocation
  happens in the feeder thread instead of inside the worker's fetch.
- omp-fork: the training process has run an OpenMP parallel region (torch's CPU wheel uses GNU
  libgomp); then each sample is transformed by a "library" that starts its own 2-thread OpenMP
  region in the worker, as OpenCV does. GNU libgomp is not fork-safe: the worker waits forever
  for pool threads that were not copied by fork.
"""

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
import traceback

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

CASES = ["getitem", "collate", "fd-limit", "fd-limit-feeder", "shm-full", "shm-full-feeder",
         "omp-fork"]
FIXES = {  # the documented fixes, first = the one plain `--fix` applies
    "getitem": ["validate"],                       # drop bad records before training
    "collate": ["pad", "equal-length"],            # a padding collate_fn / equal-length samples
    # set_sharing_strategy("file_system") / raise the soft limit / keep copies, not the batches
    "fd-limit": ["file-system", "ulimit", "clone"],
    "fd-limit-feeder": ["file-system", "ulimit"],
    "shm-full": ["shm-size", "fewer-in-flight", "no-workers"],
    "shm-full-feeder": ["shm-size", "no-workers"],
    "omp-fork": ["one-thread", "spawn", "forkserver"],  # worker_init_fn / multiprocessing_context
}
# Advice that does NOT remove the error; named with --fix to show it (not part of --fix all).
NOT_FIXES = {"shm-full": ["file-system"]}  # file_system still puts every batch in /dev/shm
NAMESPACE_MARK = "DATALOADER_ERRORS_PARENT_MNT_NS"  # set by the re-run under unshare
BIG_SHM = "64m"  # the fix "shm-size": what `docker run --shm-size=64m` would give
# shm cases: the training step each batch takes. Slower than loading, as in real training, so
# the workers fill every prefetch slot while it runs: the batches in flight are then as many as
# the loader allows, every run, instead of depending on how fast this loop drains them.
SHM_STEP_S = 0.1


# --- datasets and collate functions (top level: spawn and forkserver pickle them) -----------

class RecordsDataset(Dataset):
    """Records parsed from a manifest; record 13 lacks its "label" field (a bad line in the
    manifest). validate drops such records up front instead of failing mid-epoch."""

    def __init__(self, num_samples, validate=False):
        self.records = [{"x": float(i), "label": i % 2} for i in range(num_samples)]
        del self.records[13]["label"]
        if validate:
            self.records = [r for r in self.records if "label" in r]

    def __len__(self):
        return len(self.records)

    def __getitem__(self, index):
        record = self.records[index]
        return torch.tensor([record["x"]]), record["label"]


class RaggedDataset(Dataset):
    """Sample i has 3 + i % 5 elements (variable-length text or audio); equal_length crops or
    pads every sample to one length instead."""

    def __init__(self, num_samples, equal_length=None):
        self.num_samples, self.equal_length = num_samples, equal_length

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        sample = torch.arange(3 + index % 5, dtype=torch.float32)
        if self.equal_length is not None:
            sample = torch.nn.functional.pad(sample, (0, self.equal_length))[:self.equal_length]
        return sample


def pad_collate(samples):
    """Pad to the longest sample in the batch; keep the true lengths for masking."""
    lengths = torch.tensor([len(s) for s in samples])
    return pad_sequence(samples, batch_first=True), lengths


class TensorsDataset(Dataset):
    """Each sample is `tensors_per_sample` tensors of `sample_kib` KiB each."""

    def __init__(self, num_samples, tensors_per_sample, sample_kib):
        self.num_samples, self.tensors_per_sample = num_samples, tensors_per_sample
        self.numel = sample_kib * 1024 // 4  # float32

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        return [torch.full((self.numel,), float(index)) for _ in range(self.tensors_per_sample)]


def list_collate(samples):
    """No stacking: the batch is a flat list of the samples' tensors, one storage each (a dict
    of many fields, or a detection target list, behaves the same)."""
    return [t for sample in samples for t in sample]


def stack_collate(samples):
    """One tensor per field: what default_collate does with a list of tensors."""
    return torch.utils.data.default_collate([torch.stack(s) for s in samples])


TRANSFORM_THREADS = 2  # the "library"'s own thread setting, inherited through fork


def set_transform_threads(num_threads):
    """Stands in for cv2.setNumThreads(n): a global, per-process library setting."""
    global TRANSFORM_THREADS
    TRANSFORM_THREADS = num_threads


def single_threaded_transform(worker_id):
    """worker_init_fn: runs in each worker before its first sample, like
    `worker_init_fn=lambda _: cv2.setNumThreads(0)`."""
    set_transform_threads(1)


class ThreadedTransformDataset(Dataset):
    """Each sample goes through a transform that runs its own OpenMP parallel region."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        torch.set_num_threads(TRANSFORM_THREADS)  # the library sizes its own pool
        return torch.full((1_000_000,), float(index)).exp().sum()  # large enough to go parallel


# --- private /dev/shm --------------------------------------------------------------------

def mount_namespace():
    return os.readlink("/proc/self/ns/mnt")


def in_private_namespace():
    """True only inside the re-run this drill started: its mount namespace differs from the one
    the parent recorded. Never mount over a /dev/shm that other processes use."""
    parent = os.environ.get(NAMESPACE_MARK)
    return parent is not None and parent != mount_namespace()


def rerun_in_private_namespace(argv):
    """Replace this process with the same command under `unshare --mount`; return the reason
    when that is not possible (then the shm cases are skipped, the others still run)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "unshare(1) is not installed"
    probe = subprocess.run([unshare, "--mount", "--propagation", "private", "true"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare --mount is not permitted here (needs root): {probe.stderr.strip()}"
    os.environ[NAMESPACE_MARK] = mount_namespace()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(unshare, [unshare, "--mount", "--propagation", "private", sys.executable,
                       os.path.abspath(__file__), *argv])


def mount_shm(size):
    if not in_private_namespace():
        raise AssertionError("refusing to mount over /dev/shm outside the drill's namespace")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", "/dev/shm"],
                   check=True, timeout=30)


def shm_used_mib():
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize / 2**20


# --- one run of one case -----------------------------------------------------------------

class Run:
    """What one case (with or without a fix) needs: a dataset, loader options, and process
    state to set before the epoch and restore after it."""

    def __init__(self, case, fix, args):
        self.case, self.fix, self.args = case, fix, args
        self.keep_batches = False  # fd-limit: the loop holds every batch
        self.fd_limit = None       # soft RLIMIT_NOFILE during the epoch
        self.shm_size = None       # tmpfs size mounted over /dev/shm during the epoch
        self.strategy = "file_descriptor"  # torch's default on Linux
        self.clone = False
        self.options = dict(batch_size=4, num_workers=args.num_workers)
        self.dataset = self.build()

    def build(self):
        """The dataset for this case; sets the loader options and process state it needs."""
        case, fix, a = self.case, self.fix, self.args
        if case == "getitem":
            return RecordsDataset(32, validate=fix == "validate")
        if case == "collate":
            if fix == "pad":
                self.options["collate_fn"] = pad_collate
            return RaggedDataset(32, equal_length=8 if fix == "equal-length" else None)
        if case.startswith("fd-limit"):
            self.keep_batches, self.clone = True, fix == "clone"
            # "ulimit": the soft limit raised to the hard one, as `ulimit -n $(ulimit -Hn)` does
            self.fd_limit = hard_fd_limit() if fix == "ulimit" else a.fd_limit
            if fix == "file-system":
                self.strategy = "file_system"
            self.options["collate_fn"] = list_collate
            per_sample = a.tensors_per_sample * (16 if case == "fd-limit-feeder" else 1)
            return TensorsDataset(64, per_sample, sample_kib=1)
        if case.startswith("shm-full"):
            self.shm_size = BIG_SHM if fix == "shm-size" else a.shm_size
            if fix == "file-system":  # not a fix: see NOT_FIXES
                self.strategy = "file_system"
            if fix == "fewer-in-flight":
                self.options.update(num_workers=1, prefetch_factor=1)
            if fix == "no-workers":
                self.options["num_workers"] = 0
            feeder = case == "shm-full-feeder"
            self.options["collate_fn"] = list_collate if feeder else stack_collate
            return TensorsDataset(32, 1, a.sample_kib)
        assert case == "omp-fork", case
        if fix == "one-thread":
            self.options["worker_init_fn"] = single_threaded_transform
        if fix in ("spawn", "forkserver"):
            self.options["multiprocessing_context"] = fix
        return ThreadedTransformDataset()

    def loader(self):
        options = dict(self.options)
        if options["num_workers"] > 0:
            options["timeout"] = self.args.timeout_s
        return DataLoader(self.dataset, **options)

    def label(self):
        return f"case {self.case}" + (f" --fix {self.fix}" if self.fix else "")


def hard_fd_limit():
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def set_fd_limit(soft):
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard_fd_limit()))


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def run_epoch(run):
    """One epoch; returns True if it completed. Prints one summary line either way."""
    if run.case == "omp-fork":
        torch.set_num_threads(2)
        torch.full((1_000_000,), 1.0).exp().sum()  # the training step: an OpenMP region ran
    saved_limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    saved_strategy = torch.multiprocessing.get_sharing_strategy()
    if run.shm_size:
        mount_shm(run.shm_size)
    torch.multiprocessing.set_sharing_strategy(run.strategy)
    kept, count, peak_shm, t0, it, batch = [], 0, 0.0, time.perf_counter(), None, None
    try:
        if run.fd_limit:
            set_fd_limit(run.fd_limit)
        it = iter(run.loader())
        for count, batch in enumerate(it, start=1):
            if run.keep_batches:
                kept.append([t.clone() for t in batch] if run.clone else batch)
            if run.shm_size:
                time.sleep(SHM_STEP_S)  # the step: the workers refill meanwhile
                peak_shm = max(peak_shm, shm_used_mib())
    except (RuntimeError, KeyError) as exc:  # a worker's error keeps its type (KeyError here)
        report_failure(run, exc, count, time.perf_counter() - t0)
        drop_tracebacks(exc)
        return False
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, saved_limit)
        # Free every shared batch and shut the workers down now, before /dev/shm is unmounted:
        # with file_system a segment freed later is unlinked by name from the wrong /dev/shm.
        del it, kept, batch
        torch.multiprocessing.set_sharing_strategy(saved_strategy)
        if run.shm_size:
            subprocess.run(["umount", "--lazy", "/dev/shm"], check=True, timeout=30)
    extra = f" | /dev/shm {run.shm_size}, peak used {peak_shm:.1f} MiB" if run.shm_size else ""
    print(f"{run.label()}: ok: {count} batches in {time.perf_counter() - t0:.2f} s{extra}",
          flush=True)
    return True


def drop_tracebacks(exc):
    """The loader re-raises a worker's error from a local variable, so the exception, its
    traceback and the iterator form a reference cycle: the iterator (and its workers) would
    live until the garbage collector runs, and its shutdown would then wait 5 s per worker."""
    while exc is not None:
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def report_failure(run, exc, count, elapsed):
    """What a training loop sees, plus the one line the tests and the pages grep. A real job
    lets the error propagate (torchrun then stops the other ranks); the drill goes on."""
    fds = f" | open fds {open_fds()} of soft limit {run.fd_limit}" if run.fd_limit else ""
    lines = str(exc).strip().splitlines()
    original = f" | original: {lines[-1]}" if len(lines) > 1 else ""
    traceback.print_exc()
    # One write, newline included: print() writes the line and its end separately, and a
    # worker's traceback landing between the two would be glued onto this line.
    sys.stderr.write(f"\n{run.label()}: failed after {elapsed:.2f} s at batch {count}: "
                     f"{type(exc).__name__}: {lines[0]}{original}{fds}\n")
    sys.stderr.flush()


# --- command line --------------------------------------------------------------------------

class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None):
    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=CASES, nargs="+", default=["collate"],
                   help="which error to cause; several run one after another")
    p.add_argument("--fix", nargs="*", metavar="NAME",
                   help="apply the documented fix: no NAME = each case's first fix, NAME... = "
                        "those fixes, 'all' = every fix of each case (see FIXES)")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--timeout-s", type=float, default=5.0,
                   help="DataLoader(timeout=...): seconds next() may wait for one batch")
    p.add_argument("--fd-limit", type=int, default=128,
                   help="fd-limit cases: the soft open-files limit (what `ulimit -n` sets)")
    p.add_argument("--tensors-per-sample", type=int, default=4,
                   help="fd-limit cases: tensors in each sample (x16 for fd-limit-feeder)")
    p.add_argument("--shm-size", default="8m",
                   help="shm cases: size of the tmpfs mounted over /dev/shm (tmpfs size=)")
    p.add_argument("--sample-kib", type=int, default=512,
                   help="shm cases: KiB per sample (4 samples per batch)")
    args = p.parse_args(argv)
    if args.num_workers < 0:
        p.error(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.timeout_s <= 0:
        p.error(f"--timeout-s must be > 0 (every drill run is bounded), got {args.timeout_s}")
    if args.fd_limit < 32:
        p.error(f"--fd-limit must be >= 32 (the interpreter needs some), got {args.fd_limit}")
    for name in args.fix or []:
        if name != "all" and not any(name in fixes_of(case) for case in args.case):
            p.error(f"--fix {name} is not a fix of {args.case}; fixes: {FIXES}")
    return args


def fixes_of(case):
    return FIXES[case] + NOT_FIXES.get(case, [])


def runs(args):
    """(case, fix) pairs in order: every case, with the fixes asked for ("all" and names)."""
    for case in args.case:
        if args.fix is None:
            yield case, None
        elif not args.fix:
            yield case, FIXES[case][0]
        else:
            names = FIXES[case] if "all" in args.fix else []
            names += [f for f in args.fix if f in fixes_of(case) and f not in names]
            yield from ((case, name) for name in names)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    skip = None
    if any(c.startswith("shm-full") for c in args.case) and not in_private_namespace():
        skip = rerun_in_private_namespace(argv)  # returns only when it could not
    failed = 0
    for case, fix in runs(args):
        if skip and case.startswith("shm-full"):
            print(f"case {case}: skipped: {skip}", flush=True)
            continue
        failed += not run_epoch(Run(case, fix, args))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
