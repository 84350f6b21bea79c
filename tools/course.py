"""`make course`: run every lab, execute every lesson, build the site, print a summary.

Labs run with their default (short) config on the hardware present: each lab itself picks
CUDA + NCCL when every rank has a GPU, else CPU + gloo. Outputs go to build/course/.
"""

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import build_site as site_builder  # tools/build_site.py (a module name no function here shadows)
import lessons as lesson_tools  # tools/lessons.py (this directory is on sys.path)
import verified  # tools/verified.py

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "course"



def torch_cuda_count():
    import torch

    return torch.cuda.device_count()


def default_world_size():
    gpus = torch_cuda_count()
    return gpus if gpus >= 2 else 2


# lab05 composes three axes, and at 2 ranks its automatic layout has only one (tp 2): on CPU it
# runs at the 8 ranks of its own launch line (pp 2 x dp 2 x tp 2), which 2 cores manage in
# about 30 s. On GPUs every lab runs at the GPU count.
CPU_WORLD_SIZE = {"lab05_3d": 8}


def world_size_for(lab, nproc, on_gpus):
    return nproc if on_gpus else CPU_WORLD_SIZE.get(lab.stem, nproc)


def summary_of(log_path):
    """The lab's own "done | ..." line: warnings printed after it are not the result."""
    done = [line for line in log_path.read_text().splitlines() if line.startswith("done | ")]
    return done[-1] if done else "(no summary line: see " + str(log_path) + ")"


def run_lab(lab, nproc, timeout_s):
    metrics_path = OUT / f"{lab.stem}.json"
    metrics_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), str(lab), "--check-parity", "--amp", "off",
           "--metrics-out", str(metrics_path)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    (OUT / f"{lab.stem}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print("FAILED\n" + proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"{lab.name} failed (exit {proc.returncode}); log: "
                         f"{OUT / (lab.stem + '.log')}")
    metrics = json.loads(metrics_path.read_text())
    verified.record_lab_run(metrics, "make course")
    metrics["launch_wall_s"] = time.perf_counter() - t0
    return metrics


# Lessons whose checks compare measured step times with a formula (the pipeline bubble, the
# step-time model): they run after the others, alone, so that no other lesson shares the cores
# with the steps they time. Every other lesson asserts counts, bytes, order and parity.
RUN_ALONE = {"06_performance"}


def execute_lessons(jobs):
    """Execute each lesson that has no current executed notebook (the suite's nbval run
    leaves one), `jobs` at a time, each in a process of its own. A lesson's kernel output
    (its workers' logs and warnings) goes to build/course/lessons/NN_x.log, shown only if it
    fails. A lesson waits on its own processes much of the time, so two at a time keep two
    cores busy."""
    lessons = lesson_tools.lesson_paths()
    number = {lesson: i for i, lesson in enumerate(lessons, 1)}
    to_run = []
    for lesson in lessons:
        if lesson_tools.cached_executed(lesson):
            print(f"[lesson {number[lesson]}/{len(lessons)}] {lesson.name}: up to date "
                  "(its executed notebook is reused)", flush=True)
        else:
            to_run.append(lesson)
    together = [lesson for lesson in to_run if lesson.stem not in RUN_ALONE]
    alone = [lesson for lesson in to_run if lesson.stem in RUN_ALONE]
    if to_run:
        print(f"[lessons] executing {len(to_run)}: {jobs} at a time"
              + (f", then {', '.join(p.name for p in alone)} alone (it times steps against "
                 "a formula)" if alone else ""), flush=True)
    for batch, workers in ((together, jobs), (alone, 1)):
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            runs = {pool.submit(execute_lesson, lesson): lesson for lesson in batch}
            for run in concurrent.futures.as_completed(runs):
                lesson = runs[run]
                seconds, error = run.result()
                status = f"{seconds:.0f} s" if error is None else f"FAILED after {seconds:.0f} s"
                print(f"[lesson {number[lesson]}/{len(lessons)}] {lesson.name}: {status}",
                      flush=True)
                if error is not None:
                    for pending in runs:
                        pending.cancel()
                    print(error, flush=True)
                    raise SystemExit(f"{lesson.name} failed: open it in JupyterLab to run the "
                                     "cell yourself")
    return lessons


def execute_lesson(lesson):
    """(seconds, None) once the lesson ran top to bottom, or (seconds, what failed)."""
    log = OUT / "lessons" / (lesson.stem + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "lessons.py"), str(lesson),
                           "--log", str(log), "--source", "make course"],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode == 0:
        return seconds, None
    kernel_output = tail(log) if log.exists() else "(none)"
    return seconds, (f"{proc.stdout}{proc.stderr}\n--- the kernel's own output, last lines "
                     f"({log}):\n{kernel_output}")


def tail(path, lines=40):
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def build_site_editions():
    print("[site] mkdocs build --strict, English and 简体中文 (site/zh/) at the same time ...",
          end=" ", flush=True)
    seconds = site_builder.build(quiet=True)
    print(" | ".join(f"{lang} {s:.0f} s" for lang, s in seconds.items()), flush=True)
    return ROOT / "site" / "index.html"


def gib(num_bytes):
    return f"{num_bytes / 2**30:.2f}"


def mfu_cell(metrics):
    """MFU and what it is measured against: the CPU's own matmul peak, or a GPU datasheet."""
    if metrics.get("mfu") is None:
        return f"n/a ({metrics.get('peak_source', 'no peak')})"
    source = metrics["peak_source"]
    against = "CPU matmul peak" if source.startswith("measured") else source.split(",")[0]
    return f"{metrics['mfu']:.1%} of {against}"


def summary_table(results):
    header = ["lab", "backend", "world", "steps", "final loss", "parity", "tok/s", "MFU",
              "peak mem/rank GiB", "wall s"]
    rows = []
    for m in results:
        parity = m["parity_max_abs_diff"]
        peaks = m["peak_mem_bytes_per_rank"]
        rows.append([m["lab"], m["backend"], str(m["world_size"]), str(m["steps"]),
                     f"{m['final_loss']:.4f}",
                     "n/a" if parity is None else f"{parity:.1e} (<= {m['parity_tol']:.0e})",
                     f"{m['tokens_per_s']:.0f}", mfu_cell(m), f"{gib(min(peaks))}-{gib(max(peaks))}",
                     f"{m['wall_time_s']:.1f}"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda row: " | ".join(c.ljust(w) for c, w in zip(row, widths))  # noqa: E731
    return "\n".join([fmt(header), "-+-".join("-" * w for w in widths), *map(fmt, rows)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=0,
                        help="ranks per lab (default: every GPU if >= 2, else 2 CPU processes)")
    parser.add_argument("--skip-site", action="store_true", help="labs and lessons only")
    parser.add_argument("--lab-timeout-s", type=int, default=600, help="limit per lab run")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="lessons executed at a time (default: 2, or 1 on one core)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    nproc = args.nproc or default_world_size()
    t_start = time.perf_counter()
    labs = lesson_tools.lab_paths()
    results = []
    on_gpus = nproc >= 2 and nproc <= torch_cuda_count()
    for i, lab in enumerate(labs, 1):
        ranks = world_size_for(lab, nproc, on_gpus)
        print(f"[lab {i}/{len(labs)}] {lab.name}: torchrun x{ranks} --check-parity ...",
              end=" ", flush=True)
        results.append(run_lab(lab, ranks, args.lab_timeout_s))
        print(f"{results[-1]['launch_wall_s']:.0f} s | {summary_of(OUT / (lab.stem + '.log'))}",
              flush=True)
    (OUT / "summary.json").write_text(json.dumps(results, indent=2))
    stage_s = {"labs": time.perf_counter() - t_start}
    t_lessons = time.perf_counter()
    lessons = execute_lessons(max(1, args.jobs))
    stage_s["lessons"] = time.perf_counter() - t_lessons
    site = None
    if not args.skip_site:
        t_site = time.perf_counter()
        site = build_site_editions()
        stage_s["site"] = time.perf_counter() - t_site
    print("\n" + summary_table(results))
    print(f"\n{len(labs)} labs, {len(lessons)} lessons"
          f"{'' if site is None else f', site at {site.relative_to(ROOT)}'} | "
          + ", ".join(f"{stage} {s:.0f} s" for stage, s in stage_s.items())
          + f" | {time.perf_counter() - t_start:.0f} s in total")


if __name__ == "__main__":
    main()
