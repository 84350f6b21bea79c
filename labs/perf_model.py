"""Step-time model: how long one training step should take, from compute and communication.

    t_step    = t_compute + t_exposed
    t_compute = FLOPs per step per rank / peak FLOP/s per rank
    t_coll(S) = a + b * S          per collective of S bytes, fitted on this machine (lesson 00:
                                   for a ring all-reduce a = 2(n-1) alpha, b = 2(n-1) / (n B))
    t_exposed = sum of t_coll over the step's collectives, minus what overlaps compute

Two bounds bracket a step: "exposed" (nothing overlaps: compute then communication) and
"overlapped" (communication hidden behind compute, up to the compute time). A rank whose cores
also drive the communication (gloo on CPU) sits near the exposed bound; a GPU with NCCL on its
own stream can approach the overlapped one.

The collectives per step, per strategy (n ranks, P parameter bytes in fp32 or the gather dtype):
    ddp     one all-reduce of the gradients, in buckets of --bucket-cap-mb (25 MiB)
    fsdp    per block: an all-gather in forward, another in backward (the blocks reshard
            after forward), a reduce-scatter of its gradients; the root (embeddings, final
            norm, output) once each: fully_shard's default keeps the root gathered after
            forward (reshard_after_forward=None), so backward needs no second all-gather

Torch and stdlib only: the decision guide (tools/decision_guide.py) and lesson 06 import it.

    python labs/perf_model.py --check --out build/perf_model.json
        measures this machine (the collectives' fit, then lab01 and lab02 at 2 ranks and two
        widths) and writes, per case, predicted_s and measured_s. --reuse FOLDER takes a case's
        steps from a metrics JSON an earlier run with the same settings wrote (case_args).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

LABS = Path(__file__).resolve().parent
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb


@dataclass(frozen=True)
class CollectiveFit:
    """t(S) = latency_s + seconds_per_byte * S for one collective at one world size."""
    latency_s: float
    seconds_per_byte: float

    def seconds(self, num_bytes):
        return self.latency_s + self.seconds_per_byte * num_bytes


def fit_collective(rows):
    """Least squares on t = a + b S, weighted by 1/t so small and large messages count alike
    (lesson 00's fit). rows: [(bytes, seconds)]."""
    # Normal equations of sum(((a + b S) / t - 1)^2), solved by hand: torch and stdlib only.
    s11 = sum(1 / t ** 2 for _, t in rows)
    s12 = sum(s / t ** 2 for s, t in rows)
    s22 = sum(s * s / t ** 2 for s, t in rows)
    r1 = sum(1 / t for _, t in rows)
    r2 = sum(s / t for s, t in rows)
    det = s11 * s22 - s12 * s12
    a, b = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if a <= 0 or b <= 0:
        raise ValueError(f"fit t = a + b S gave a = {a:.3g}, b = {b:.3g}: not a latency and a "
                         "bandwidth; measure more sizes")
    return CollectiveFit(a, b)


def ddp_collectives(grad_bytes, bucket_bytes=DDP_BUCKET_BYTES):
    """[(op, bytes)] of one DDP step: the gradients all-reduced bucket by bucket."""
    full, rest = divmod(grad_bytes, bucket_bytes)
    return [("all_reduce", bucket_bytes)] * full + ([("all_reduce", rest)] if rest else [])


def fsdp_collectives(unit_param_bytes, gather_bytes_per_param=4, reduce_bytes_per_param=4):
    """[(op, bytes)] of one FSDP step, unit by unit. unit_param_bytes: fp32 bytes of each unit's
    parameters (blocks, then the root, last). The all-gather's S is the gathered (output) buffer
    and the reduce-scatter's S its input, as comm_bench measures them. A block is gathered in
    forward and again in backward; the root once (it stays gathered after forward): 2L + 1
    all-gathers, as lab03's test counts them."""
    out = []
    for index, fp32_bytes in enumerate(unit_param_bytes):
        numel = fp32_bytes // 4
        gathers = 1 if index == len(unit_param_bytes) - 1 else 2  # the root: forward only
        out += [("all_gather", numel * gather_bytes_per_param)] * gathers
        out.append(("reduce_scatter", numel * reduce_bytes_per_param))
    return out


# Passes over a parameter-sized fp32 tensor in one optimizer step, each read or write counted:
# clip_grad_norm_ (read the grads for the norm, read and write them to scale: 3) and AdamW's
# single-tensor loop on CPU (torch/optim/adam.py, _single_tensor_adam: the decoupled decay
# 2, exp_avg lerp 3, exp_avg_sq mul + addcmul 3 + 3, the denominator sqrt / add 2 + 2, the
# update addcdiv 4: 19). Memory-bound: it runs at the machine's copy bandwidth, not its FLOPs.
OPTIMIZER_PASSES = 3 + 19


def optimizer_seconds(params_held, traffic_bytes_per_s, passes=OPTIMIZER_PASSES):
    return passes * 4 * params_held / traffic_bytes_per_s


def predict_step(flops_per_rank, peak_flops, collectives, fits, optimizer_s=0.0):
    """Seconds per step: compute, the optimizer step, the communication, and the two bounds
    (communication exposed after compute, or hidden behind it)."""
    compute = flops_per_rank / peak_flops
    comm = sum(fits[op].seconds(num_bytes) for op, num_bytes in collectives)
    return {"compute_s": compute, "optimizer_s": optimizer_s, "comm_s": comm,
            "exposed_s": compute + optimizer_s + comm,
            "overlapped_s": max(compute, comm) + optimizer_s}


def datasheet_tokens_per_s(strategy, num_params, flop_per_token, tokens_per_gpu, world_size,
                           peak_flops, link_bytes_per_s, gather_bytes=2, reduce_bytes=4):
    """The same model for a cluster described by datasheet figures: compute at the peak, and
    the strategy's traffic per GPU per step, each collective a ring moving (n-1)/n of its
    buffer over one link of link_bytes_per_s.
        ddp   one all-reduce of the gradients in the reduce dtype: 2 (n-1)/n x P x reduce_bytes
        fsdp  all-gathers of the parameters in the gather dtype, in forward and again in
              backward, and one reduce-scatter of the gradients: (2 x gather + reduce) (n-1)/n P
    Returns the seconds of each, and tokens per second per GPU with the communication exposed
    and hidden behind compute."""
    traffic_per_param = {"ddp": 2 * reduce_bytes, "fsdp": 2 * gather_bytes + reduce_bytes}
    compute = flop_per_token * tokens_per_gpu / peak_flops
    ring = (world_size - 1) / world_size
    comm = num_params * traffic_per_param[strategy] * ring / link_bytes_per_s
    return {"compute_s": compute, "comm_s": comm,
            "exposed_tokens_per_s": tokens_per_gpu / (compute + comm),
            "overlapped_tokens_per_s": tokens_per_gpu / max(compute, comm)}


# ---------------------------------------------------------------- --check: this machine
def run(cmd, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True,
                          env=env)


def torchrun(script, nproc, args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), str(LABS / script), *map(str, args)]


def measure_fits(nproc, folder):
    """comm_bench at nproc ranks: one fit per collective the strategies use."""
    out = Path(folder) / "comm.json"
    # Sizes x4 apart, 4K to 64M: the fit is a straight line, and 8 sizes pin it as well as 15
    # did. The labs' biggest collective, a lab02 block at width 1024 (67,117,056 bytes), sits
    # just past 64 MiB, where the line is extended by 0.01%.
    run(torchrun("comm_bench.py", nproc, ["--ops", "all_reduce,all_gather,reduce_scatter",
                                          "--min-bytes", "4K", "--max-bytes", "64M",
                                          "--step-factor", "4", "--iters", "10",
                                          "--json-out", out]))
    report = json.loads(out.read_text())
    fits = {op: fit_collective([(r["bytes"], r["time_us"] / 1e6) for r in report["rows"]
                                if r["op"] == op])
            for op in ("all_reduce", "all_gather", "reduce_scatter")}
    # memcpy moves each byte twice (one read, one write): traffic = 2 x copy bandwidth.
    return fits, 2 * report["memcpy_gbps"] * 1e9


def measured_step_s(metrics):
    """Mean step time after the first window (warm-up), from the lab's own StepLog windows."""
    steady = metrics["step_windows"][1:] or metrics["step_windows"]
    return sum(w["seconds"] for w in steady) / sum(w["steps"] for w in steady)


def unit_param_bytes(shapes):
    """fp32 bytes of each FSDP unit of the lab model: every block, then the root's rest."""
    units = {}
    for name, shape in shapes.items():
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        units[key] = units.get(key, 0) + 4 * math.prod(shape)
    return [bytes_ for key, bytes_ in units.items() if key != "root"] + [units["root"]]


# A copy of the kit's measure_matmul_peak (tests/test_lab_copy.py keeps the copies
# identical): this module may import only torch, never a lab.
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


def measure_peak():
    """This machine's matmul peak per thread, measured once, for every case: the peak each
    lab run reports is measured at its end, while the other rank may still be busy, and
    varied by 10% between runs (88-101 GFLOP/s), enough to turn the bound upside down."""
    torch.set_num_threads(1)  # what each rank of a lab run uses
    return measure_matmul_peak(torch.device("cpu"), torch.float32, seconds=0.2, bursts=5)


def heads_for(dim):
    return max(4, dim // 64)


def case_args(dim):
    """The lab settings of a --check case at this width. Sync points at steps 1, 5 and 6: the
    first step (warm-up, or a compile) is a window of its own, and steps 2 to 6 are timed.
    No --check-parity: its single-process reference would double the run and time nothing."""
    return ["--dim", dim, "--num-heads", heads_for(dim), "--steps", 6, "--log-every", 5,
            "--amp", "off"]


CHECKED_LABS = ("lab01_ddp", "lab02_fsdp")  # the strategies --check compares: DDP, FSDP


def case_file(folder, lab, dim):
    """Where a case's metrics live: the name --reuse looks for (e.g. lab02_fsdp-1024.json)."""
    return Path(folder) / f"{lab}-{dim}.json"


def reusable(path, dim, nproc):
    """A metrics file an earlier run of the same case wrote (lesson 06's eager run, say): used
    only if that run had case_args's values, this world size and no --compile. Other flags
    are not compared: put only runs made with case_args alone (plus --metrics-out) there."""
    if not path.exists():
        return None
    metrics = json.loads(path.read_text())
    flags, values = case_args(dim)[::2], case_args(dim)[1::2]
    same = all(metrics["config"].get(flag[2:].replace("-", "_")) == value
               for flag, value in zip(flags, values))
    if same and metrics["world_size"] == nproc and not metrics["config"].get("compile"):
        return metrics
    return None


def run_case(lab, dim, nproc, folder):
    metrics_path = case_file(folder, lab, dim)
    run(torchrun(f"{lab}.py", nproc, [*case_args(dim), "--metrics-out", metrics_path]))
    return json.loads(metrics_path.read_text())


def check_case(lab, dim, nproc, fits, traffic, peak, folder, reuse_dir=None):
    reused = reusable(case_file(reuse_dir, lab, dim), dim, nproc) if reuse_dir else None
    metrics = reused or run_case(lab, dim, nproc, folder)
    tokens_per_rank = metrics["config"]["batch_size"] * metrics["config"]["seq_len"] / nproc
    flops = metrics["flops_per_token"] * tokens_per_rank
    shapes = metrics["parameter_shapes"]  # the lab writes its own model's shapes
    num_params = sum(math.prod(s) for s in shapes.values())
    if lab == "lab02_fsdp":
        collectives, held = fsdp_collectives(unit_param_bytes(shapes)), num_params / nproc
    else:
        collectives, held = ddp_collectives(4 * num_params), num_params
    predicted = predict_step(flops, peak, collectives, fits, optimizer_seconds(held, traffic))
    return {"lab": lab, "dim": dim, "nproc": nproc, "measured_s": measured_step_s(metrics),
            "predicted_s": predicted["exposed_s"], **predicted,
            "peak_flops_per_rank": peak, "mfu": metrics["mfu"], "reused": reused is not None}


def input_problem(args):
    """What is wrong with the command line, in one line, or None."""
    dims = args.dims.split(",")
    if not all(dim.isdigit() and int(dim) > 0 for dim in dims):
        return f"--dims {args.dims!r}: give positive widths separated by commas, e.g. 256,1024"
    for dim in map(int, dims):
        if dim % heads_for(dim) or dim // heads_for(dim) % 2:  # the labs' RoPE needs even heads
            return (f"--dims: width {dim} does not split into {heads_for(dim)} heads of an "
                    f"even size; use a multiple of {2 * heads_for(dim)}, e.g. 256")
    if args.nproc < 1:
        return f"--nproc {args.nproc}: must be at least 1"
    if args.reuse and not Path(args.reuse).is_dir():
        return f"--reuse {args.reuse}: no such folder"
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="measure this machine and compare the model with real steps")
    parser.add_argument("--nproc", type=int, default=2, help="ranks for --check")
    parser.add_argument("--dims", default="256,512", help="model widths for --check")
    parser.add_argument("--out", default="", help="write the --check results as JSON here")
    parser.add_argument("--reuse", default="",
                        help="a folder of metrics JSON from earlier runs made with case_args "
                             "alone (named LAB-DIM.json, e.g. lab02_fsdp-1024.json): each one "
                             "that matches is used instead of running that case again")
    args = parser.parse_args(argv)
    problem = input_problem(args)
    if problem:
        parser.exit(2, f"perf_model.py: error: {problem}\n")  # one line, nothing started
    if not args.check:
        parser.print_help()
        return 0
    with tempfile.TemporaryDirectory() as folder:
        fits, traffic = measure_fits(args.nproc, folder)
        peak = measure_peak()
        cases = [check_case(lab, int(dim), args.nproc, fits, traffic, peak, folder, args.reuse)
                 for lab in CHECKED_LABS for dim in args.dims.split(",")]
    result = {"fits": {op: vars(fit) for op, fit in fits.items()}, "peak_flops": peak,
              "memory_traffic_bytes_per_s": traffic, "cases": cases}
    for case in cases:
        print(f"{case['lab']:<11} dim {case['dim']:>4}: "
              f"predicted {case['predicted_s'] * 1e3:7.1f} ms "
              f"(compute {case['compute_s'] * 1e3:.1f} + optimizer {case['optimizer_s'] * 1e3:.1f} "
              f"+ comm {case['comm_s'] * 1e3:.1f}), "
              f"measured {case['measured_s'] * 1e3:7.1f} ms, "
              f"ratio {case['measured_s'] / case['predicted_s']:.2f}"
              f"{' (measured by the reused run)' if case['reused'] else ''}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
