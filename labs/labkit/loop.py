"""The training loop every lab shares: the learning-rate schedule, one optimizer step of
gradient accumulation, the step log (losses and times read from the device at sync points
only), preemption by SIGTERM, and checkpoints at the steps --checkpoint-every names. Each lab
passes in what is its own: how it skips gradient sync, its step and its save."""

import contextlib
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from labkit.faults import maybe_inject_failure, maybe_stall
from labkit.model import loss_fn

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "stopped on request, checkpoint written, rerun me"


def learning_rate(cfg, step):
    """Linear warmup from 0 over --warmup-steps (the shape of Hugging Face's
    get_linear_schedule_with_warmup), then constant. A pure function of the step, so a resumed
    run needs no scheduler state.

    Why it matters for parity: Adam's first update is lr * g / (|g| + eps), which is close to
    lr * sign(g) for every entry with |g| well above eps = 1e-8, however small g is next to the
    rest of the gradient. Such an entry can be rounding noise, and any change in summation order
    (a bucketed all-reduce over 3 ranks, TP's split matmuls) can flip its sign, moving that weight
    about 2 * lr away from the single-process run. With lr 0 at step 1, the first real update
    divides each entry by the RMS of two steps' gradients, and one noisy value no longer
    decides. Early-step Adam variance is also why transformer recipes warm up (arXiv:1908.03265).
    """
    if cfg.warmup_steps == 0:
        return cfg.lr
    return cfg.lr * min(1.0, (step - 1) / cfg.warmup_steps)


def set_learning_rate(optimizers, cfg, step):
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)


def maxrss_unit_bytes(platform=sys.platform):
    """getrusage's ru_maxrss is in kilobytes on Linux and in bytes on macOS (getrusage(2))."""
    return 1 if platform == "darwin" else 1024


def peak_memory_bytes(device):
    """CUDA: peak bytes allocated by tensors. CPU: peak resident set size of the process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * maxrss_unit_bytes()


def log_line(step, loss, step_s, tokens_per_s, data_share, mem_bytes, **_):
    return (f"step {step:4d} | loss {loss:.4f} | {step_s * 1e3:.1f} ms | "
            f"{tokens_per_s:.0f} tok/s | data {data_share:.0%} | mem {mem_bytes / 2**30:.2f} GiB")


def append_metrics_line(path, fields):
    """--metrics-stream: one JSON object per logged step, appended and flushed at once, so that
    a dashboard can follow the file while the run goes on, and a resumed run continues it.
    Read it with pandas.read_json(path, lines=True), or json.loads on each line."""
    with open(path, "a") as stream:
        stream.write(json.dumps(fields) + "\n")


# --profile-dir: which steps torch.profiler records. The first step does lazy init and warm-up,
# the second warms the profiler up; steps 3 and 4 are recorded.
PROFILE_SCHEDULE = {"wait": 1, "warmup": 1, "active": 2}
PROFILED_STEPS = sum(PROFILE_SCHEDULE.values())  # a run must have this many steps to profile


@contextlib.contextmanager
def step_profiler(cfg, rank, device):
    """--profile-dir: torch.profiler over PROFILE_SCHEDULE's steps, then one trace per rank,
    DIR/rank<N>.json, in the Chrome trace format that Perfetto (ui.perfetto.dev) and
    chrome://tracing open. Yields the function to call after each step (a no-op without the
    flag). The trace is written whole or not at all (a temporary file, then a rename)."""
    if not cfg.profile_dir:
        yield lambda: None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    path = Path(cfg.profile_dir) / f"rank{rank}.json"

    def write_trace(profiler):
        partial = path.with_name(path.name + ".tmp")
        profiler.export_chrome_trace(str(partial))
        os.replace(partial, path)

    schedule = torch.profiler.schedule(**PROFILE_SCHEDULE, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule,
                                on_trace_ready=write_trace) as profiler:
        yield profiler.step


class PreemptionWatch:
    """SIGTERM (a scheduler preempting the job) only raises a flag; the loop goes on to its next
    sync point (StepLog.add), where all ranks agree in one all-reduce, so they checkpoint and
    stop together."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.requested = True


def train_step(model, optimizer, scaler, batches, cfg, device, amp_dtype, gradient_sync,
               compute_loss=None, grad_norms=None):
    """One optimizer step of cfg.grad_accum micro-steps. gradient_sync(model, enabled) is the
    lab's: a context around each micro-step's forward, loss and backward, which skips gradient
    communication on all but the last one (enabled=False). compute_loss(model, logits,
    targets): a lab whose loss is more than next-token cross-entropy (lab08 adds the experts'
    balancing loss). grad_norms: a list that gets each step's gradient norm before clipping.
    Returns (loss on the device, data-wait seconds): nothing here reads a device value on the
    host, so CUDA keeps running ahead (see StepLog)."""
    data_s, total_loss = 0.0, 0.0
    for micro in range(cfg.grad_accum):
        t0 = time.perf_counter()
        inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        data_s += time.perf_counter() - t0
        with gradient_sync(model, micro == cfg.grad_accum - 1):
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(inputs)
            loss = (compute_loss(model, logits, targets) if compute_loss
                    else loss_fn(logits, targets)) / cfg.grad_accum
            scaler.scale(loss).backward()
        loss = loss.detach()  # a replicated DTensor under TP's loss_parallel: the same everywhere
        total_loss += loss.to_local() if isinstance(loss, DTensor) else loss
    if cfg.clip:
        scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
        norm = clip_grad_norm_(model.parameters(), cfg.clip)
        if grad_norms is not None:
            grad_norms.append(norm.detach())  # on the device: read at the end of the run
    scaler.step(optimizer)  # skips the step if fp16 gradients overflowed (on any rank)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total_loss, data_s


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm):
    """torch.nn.utils.clip_grad_norm_, for gradients on different meshes too. On DTensor
    gradients (FSDP, TP) the norm of the local shards is all-reduced over the mesh, so every
    rank clips by the same global norm. Under TP without sequence parallel the norm weights
    live on "dp" only and the TP'd weights on ("dp", "tp"), and one torch.stack cannot mix
    meshes: sum squares per mesh, then combine.

    On a 2-D mesh, full_tensor() reduces one axis after the other, and DTensor logs (once)
    "2 sequential all_reduce operations will be performed ... flatten mesh dimensions". It is a
    latency hint: each all-reduce carries one scalar, once per step. The result is the same on
    every rank, because each all-reduce hands all members of a group the same bits."""
    groups = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups.values()]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    # One mesh (DDP, FSDP): its norm as it is, bit for bit what clip_grad_norm_ computes.
    total_norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm


class StepLog:
    """Losses, step times and the preemption flag, read from the device at sync points only.

    CUDA runs ahead of Python, and anything that reads a device value on the host
    (loss.item(), the result of a flag's all-reduce, torch.cuda.synchronize) makes Python
    wait until the GPU has caught up, and the launch queue runs dry. So each step's loss
    stays on the device. At a sync point (the first step, whose time includes warm-up; every
    --log-every steps; each checkpoint step; the last step) one all-reduce carries every
    pending loss and the preemption flag, and one read brings them to the host. That read
    returns only when the device has finished the window's work, so a window's time is honest
    on CUDA without a synchronize per step."""

    def __init__(self, cfg, device, start_step, last_step, loss_divisor):
        self.cfg, self.device, self.first, self.last = cfg, device, start_step + 1, last_step
        self.loss_divisor = loss_divisor  # the all-reduce sums; this turns it into the mean
        self.pending, self.losses, self.windows = [], [], []
        self.data_s, self.window_start = 0.0, time.perf_counter()

    def is_sync_point(self, step):
        every = self.cfg.checkpoint_every if self.cfg.checkpoint_dir else 0
        return (step in (self.first, self.last) or step % self.cfg.log_every == 0
                or bool(every and step % every == 0))

    def add(self, step, loss, data_s, preemption):
        """Record one step. At a sync point, returns whether any rank was asked to stop."""
        self.pending.append(loss.detach().float().reshape(1))
        self.data_s += data_s
        if not self.is_sync_point(step):
            return False
        flag = torch.tensor([float(preemption.requested)], device=self.device)
        packed = torch.cat([*self.pending, flag])
        dist.all_reduce(packed)  # SUM: every rank's losses, and how many ranks must stop
        *sums, stops = packed.tolist()  # the window's one host read
        seconds = time.perf_counter() - self.window_start
        first = step - len(sums) + 1
        self.losses += [[first + i, total / self.loss_divisor] for i, total in enumerate(sums)]
        self.windows.append({"last_step": step, "steps": len(sums), "seconds": seconds,
                             "data_s": self.data_s})
        self.pending, self.data_s, self.window_start = [], 0.0, time.perf_counter()
        return stops > 0

    def restart_window(self):
        """After a checkpoint: its time is not training time. Called at a sync point, so no
        device work is pending."""
        self.window_start = time.perf_counter()

    def fields(self, tokens_per_step):
        """The last window, as the log line and --metrics-stream report it: step time and
        throughput are the window's means, the loss is its last step's, time is Unix time."""
        window = self.windows[-1]
        step_s = window["seconds"] / window["steps"]
        return {"step": window["last_step"], "loss": self.losses[-1][1], "step_s": step_s,
                "tokens_per_s": tokens_per_step / step_s,
                "data_share": window["data_s"] / window["seconds"],
                "mem_bytes": peak_memory_bytes(self.device), "time": time.time()}

    def steady_tokens_per_s(self, tokens_per_step):
        """Throughput after the first step (compile, allocator warm-up, lazy init)."""
        steady = self.windows[1:] or self.windows
        return tokens_per_step * sum(w["steps"] for w in steady) / sum(w["seconds"] for w in steady)

    def data_share(self):
        return sum(w["data_s"] for w in self.windows) / max(sum(w["seconds"] for w in self.windows), 1e-9)


def announce(cfg, rank, world_size, device, start_step, *details):
    """Rank 0's first line: lab | backend x world | device | details... | steps first..last."""
    if rank == 0:
        print(" | ".join([cfg.lab, f"{dist.get_backend()} x{world_size}", str(device), *details,
                          f"steps {start_step + 1}..{cfg.stop_at_step or cfg.steps}"]),
              flush=True)


def train_loop(cfg, rank, device, start_step, optimizers, step_fn, save_fn, loss_divisor,
               first_step_probe=None):
    """Steps start_step+1 .. the last, each at learning_rate(step) for every optimizer:
    step_fn(step) -> (loss on the device, data seconds); save_fn(step) writes a checkpoint.
    Logs, checkpoints and preemption happen at StepLog's sync points. loss_divisor: the ranks
    whose losses the log's all-reduce sums (the data-parallel ones). first_step_probe: a
    context the first step runs in (labkit/probes.py's StepCosts). Returns the StepLog."""
    last_step = cfg.stop_at_step or cfg.steps
    log = StepLog(cfg, device, start_step, last_step, loss_divisor)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    preemption = PreemptionWatch()
    with step_profiler(cfg, rank, device) as step_done:  # --profile-dir; else a no-op
        for step in range(start_step + 1, last_step + 1):
            maybe_inject_failure(cfg, step, rank)  # the fault drills; no-ops unless asked for
            maybe_stall(cfg, step, rank, preemption)
            set_learning_rate(optimizers, cfg, step)
            measured = first_step_probe if first_step_probe and step == start_step + 1 else None
            with measured or contextlib.nullcontext():
                loss, data_s = step_fn(step)
            step_done()
            preempted = log.add(step, loss, data_s, preemption)
            if rank == 0 and (step % cfg.log_every == 0 or step == last_step):  # sync points
                fields = log.fields(tokens_per_step)
                print(log_line(**fields), flush=True)
                if cfg.metrics_stream:
                    append_metrics_line(cfg.metrics_stream, fields)
            every = cfg.checkpoint_every
            if cfg.checkpoint_dir and ((every and step % every == 0) or step == last_step
                                       or preempted):
                save_fn(step)
                log.restart_window()
            if preempted:
                if rank == 0:
                    print(f"preempted: checkpoint at step {step} written, exiting "
                          f"{PREEMPTED_EXIT_CODE}", flush=True)
                # No teardown here: the lab's models are still alive in its frames. The exit
                # unwinds to main()'s finally, whose teardown_distributed() frees them first.
                sys.exit(PREEMPTED_EXIT_CODE)
    return log
