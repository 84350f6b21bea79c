"""What a run reports: the log line every lab prints, MFU against a datasheet (or, on CPU, a
measured) peak, the metrics JSON and the final summary line."""

import time

import torch
import torch.distributed as dist

from labkit.checkpoint import write_json_atomic
from labkit.loop import peak_memory_bytes
from labkit.model import flops_per_token, parameter_shapes
from labkit.parity import (check_parity, exit_if_grad_norms_differ, exit_if_parity_fails,
                           grad_norm_diff)
from labkit.plan import gpu_spec_for

def summary_line(metrics):
    mfu = metrics["mfu"]
    fields = [f"done | {metrics['lab']} | {metrics['backend']} x{metrics['world_size']}",
              f"{metrics['steps']} steps", f"loss {metrics['final_loss']:.4f}"]
    parity = metrics["parity_max_abs_diff"]  # None: --check-parity was not asked for
    fields.append(f"parity {'n/a' if parity is None else f'{parity:.1e}'}")
    fields += [f"{metrics['tokens_per_s']:.0f} tok/s",
               f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}", f"{metrics['wall_time_s']:.1f} s"]
    return " | ".join(fields)


def measure_matmul_peak(device, dtype, size=512, seconds=0.1, bursts=3):
    """FLOP/s of one square matmul on this process's threads: the CPU's stand-in for a
    datasheet peak. Run on every rank at once, as in training, so the ranks share the cores.
    The best of a few short bursts: a burst the scheduler interrupts reads low, which makes
    the MFU read high (one run with a single 0.1 s burst reported 205%); nothing reads high."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b  # warm-up: thread pool, caches
    best = 0.0
    for _ in range(bursts):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            calls += 1
        best = max(best, 2 * size ** 3 * calls / (time.perf_counter() - t0))
    return best


def device_peak_flops(device, dtype):
    """(peak FLOP/s per device, where the figure comes from)."""
    if device.type == "cuda":
        key, spec = gpu_spec_for(torch.cuda.get_device_name(device))
        if spec is None:
            return None, f"no GPU_SPECS entry for {torch.cuda.get_device_name(device)}"
        return spec["peak_flops"], f"{key} datasheet, {'bf16' if spec['bf16'] else 'fp16'} dense"
    # fp32 whatever the run's dtype: CPUs without bf16/fp16 matrix units emulate them, slower
    # than fp32, and a slow peak would flatter the MFU (it can pass 100%).
    measured = measure_matmul_peak(device, torch.float32)
    return measured, (f"measured here: fp32 512x512 matmul on {torch.get_num_threads()} "
                      f"thread(s) per rank")


def utilisation(cfg, log, world_size, device, dtype):
    """Throughput, FLOPs per token, achieved FLOP/s per rank, the peak and MFU. Every rank
    calls it at once: on CPU each measures its matmul peak while the others do too."""
    tokens_per_s = log.steady_tokens_per_s(cfg.batch_size * cfg.seq_len)
    per_token = flops_per_token(cfg, cfg.seq_len)
    achieved = per_token * tokens_per_s / world_size
    peak, source = device_peak_flops(device, dtype)
    return {"tokens_per_s": tokens_per_s, "flops_per_token": per_token,
            "achieved_flops_per_rank": achieved, "peak_flops_per_rank": peak,
            "peak_source": source, "mfu": achieved / peak if peak else None}


def common_metrics(cfg, log, world_size, device, wall_start, usage):
    """The metrics JSON fields every lab writes (rank 0); each lab adds its own."""
    losses = log.losses
    return {
        "lab": cfg.lab, "backend": dist.get_backend(), "device": device.type,
        "world_size": world_size, "steps": losses[-1][0] if losses else 0,
        "final_loss": losses[-1][1] if losses else float("nan"), "losses": losses,
        **usage, "step_windows": log.windows,
        "first_step_s": log.windows[0]["seconds"] if log.windows else None,
        "peak_mem_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss",
        "wall_time_s": time.perf_counter() - wall_start,
        "torch_version": torch.__version__, "config": vars(cfg),
    }


def gather_per_rank(values, world_size):
    """{name: value} from every rank -> {name: [value of rank 0, rank 1, ...]}, on every rank."""
    everyone = [None] * world_size
    dist.all_gather_object(everyone, values)
    return {name: [r[name] for r in everyone] for name in values}


def finish_run(cfg, rank, world_size, device, log, amp_dtype, wall_start, full_state=None,
               extra=None, dp_size=None, own_parity=None, reference=None, grad_norms=None):
    """The end of every lab's run, on every rank: per-rank peaks and data-wait shares
    gathered, MFU measured (on CPU every rank measures its peak at once, as in training), and
    --check-parity, where full_state() gives rank 0 every parameter in full (it may be a
    collective: every rank calls it). dp_size: the ranks that split each batch, whose streams
    the reference replays (default: all; TP ranks share one). reference: a labkit/parity.py
    Reference, for a lab whose model or loss is not the kit's. grad_norms: each step's
    gradient norm (train_step's list), reported and, under --check-parity, compared with the
    reference's. own_parity: instead of full_state, for labs whose ranks check their own
    parameters (pipelines): called on every rank, it returns (metrics fields, the worst
    difference, what that is the worst of). Rank 0 writes --metrics-out and prints the
    summary; a failed parity check exits non-zero."""
    # Per rank: a straggler shows up as one rank with a much higher data-wait share.
    per_rank = gather_per_rank({"peak": peak_memory_bytes(device),
                                "data_share": log.data_share()}, world_size)
    usage = utilisation(cfg, log, world_size, device, amp_dtype)
    fields, worst, detail = {"reference_losses": None, "parity_max_abs_diff": None}, None, ""
    if cfg.check_parity and own_parity:
        fields, worst, detail = own_parity()
    elif cfg.check_parity:
        state = full_state()
        if rank == 0:
            fields, worst = check_parity(cfg, state, dp_size or world_size, device, reference)
    dist.barrier()  # the other ranks wait (within --timeout-s) for rank 0's reference
    if rank != 0:
        return
    if grad_norms is not None:
        fields["grad_norms"] = [norm.item() for norm in grad_norms]
        fields["grad_norm_max_rel_diff"] = grad_norm_diff(
            fields["grad_norms"], fields.get("reference_grad_norms") or [])
    metrics = {**common_metrics(cfg, log, world_size, device, wall_start, usage),
               "peak_mem_bytes_per_rank": per_rank["peak"],
               "data_share_per_rank": per_rank["data_share"],
               # labs/perf_model.py counts gradient bytes from these, importing no lab
               "parameter_shapes": parameter_shapes(cfg), **(extra or {}), **fields,
               "parity_tol": cfg.parity_tol}
    if cfg.metrics_out:
        write_json_atomic(cfg.metrics_out, metrics)
    print(summary_line(metrics), flush=True)
    exit_if_parity_fails(worst, cfg.parity_tol, detail)
    exit_if_grad_norms_differ(fields.get("grad_norm_max_rel_diff"))
