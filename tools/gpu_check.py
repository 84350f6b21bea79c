"""`make gpu-check`: everything in the course that needs CUDA, on the GPUs this machine has.

    python tools/gpu_check.py        # what `make gpu-check` runs
    python tools/gpu_check.py --labs lab05_3d   # only these labs' launches, after a fix

With N = torch.cuda.device_count() it runs, in this order:
  1. every lab under torchrun at world size N on NCCL, twice: its GPU defaults (`--device cuda`,
     the default --amp) for 40 steps, and fp32 (`--check-parity --amp off`; labs 02, 07, 08 also
     `--mixed-precision fp32`), which retrains in one process and compares every parameter;
  2. the GPU tier of the test suite, `pytest -m gpu tests` (the tests marked gpu: the real
     CUDA OOM and the runbook's prediction of it, memory snapshots, expandable_segments, the
     NCCL parity tests that need 2 GPUs);
  3. lab02 at the largest preset (`--model 1b`, else `small`) that its `--plan` says fits
     this GPU, for 30 steps: the tok/s and MFU a real size reaches.
Each result is printed in a table and appended to verified/gpu-check.jsonl (committed: GPU runs
are rare, so the record is kept), from which tools/verified.py's gpu_stamp() writes a lab
page's "GPU: verified on ..." sentence.

Honest by construction: a result is "passed" only when its command ran and exited 0 (and, for
a lab, printed its "done | " line and wrote its metrics). The pipeline lab at N == 1 is a
stated skip. A command past its timeout is killed with every process below it and is FAILED,
naming the command. Everything must fit DEADLINE_S (10 minutes on one GPU); what the deadline
leaves no time for is FAILED as not run. Exit 0 only if everything that ran passed. Without a
GPU: one line and exit 1, since nothing was checked.
"""

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import verified  # tools/verified.py: where the results go and how pages read them

ROOT = Path(__file__).resolve().parents[1]
LABS_DIR = ROOT / "labs"
PYTHON = sys.executable
LABS = ("lab01_ddp", "lab02_fsdp", "lab03_tp_fsdp", "lab04_pipeline", "lab05_3d",
        "lab07_context_parallel", "lab08_expert_parallel")
# Labs whose FSDP MixedPrecisionPolicy (--mixed-precision) follows --amp: fp32 for parity.
FSDP_POLICY_LABS = ("lab02_fsdp",)  # labs 07 and 08 follow --amp alone
NO_GPU = ("gpu-check: no CUDA GPU visible (torch.cuda.is_available() is False): nothing to "
          "check; run it on a GPU machine")
PIPELINE_SKIP = "the pipeline lab needs >= 2 GPUs"
STEPS, FILL_STEPS = 40, 30
FILL_MODELS = ("1b", "small")  # largest first: the first whose --plan says "fits" is run
RUN_TIMEOUT_S, PYTEST_TIMEOUT_S, PLAN_TIMEOUT_S = 240, 300, 60
DEADLINE_S = 570  # the promise is 10 minutes on one GPU; the rest is for the summary
MIN_START_S = 30  # less left than this: do not start a command only to kill it


# ---------------------------------------------------------------- the plan (pure, CPU-testable)
def torchrun(lab, num_gpus, args):
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(num_gpus), str(LABS_DIR / f"{lab}.py"), *map(str, args)]


def world_size_args(lab, num_gpus):
    """Flags a lab needs at num_gpus ranks, as its own validate_* functions demand."""
    if lab == "lab03_tp_fsdp":  # --tp must divide the world size (and the heads, dim, ...)
        return ["--tp", 2 if num_gpus % 2 == 0 else 1]
    if lab == "lab04_pipeline":
        # 1F1B needs a microbatch per stage (pp = num_gpus with --dp 1), and the global batch
        # must split into equal microbatches; at N <= 4 this is the lab's default (4, 8).
        num_microbatches = max(4, num_gpus)
        return ["--microbatches", num_microbatches, "--batch-size", 2 * num_microbatches]
    if lab == "lab07_context_parallel":  # cp must divide the world and split the debug
        return ["--cp", math.gcd(num_gpus, 8)]  # model's 32 tokens into 2 cp equal chunks
    if lab == "lab08_expert_parallel":  # ep must divide the world and the 8 experts
        return ["--ep", math.gcd(num_gpus, 8)]
    return []


def lab_run(lab, what, num_gpus, args, out_dir, model="debug"):
    metrics = Path(out_dir) / f"{lab}-{what}.json"
    args = ["--device", "cuda", *args, *world_size_args(lab, num_gpus), "--metrics-out", metrics]
    return {"lab": lab, "what": what, "model": model, "metrics": metrics,
            "cmd": torchrun(lab, num_gpus, args), "skip": None}


def planned_runs(num_gpus, out_dir):
    """Every lab launch gpu-check makes at num_gpus GPUs, in order; a run that cannot happen at
    this size carries its reason in "skip" and no command."""
    runs = []
    for lab in LABS:
        if lab == "lab04_pipeline" and num_gpus < 2:
            runs += [{"lab": lab, "what": what, "model": "debug", "metrics": None, "cmd": None,
                      "skip": PIPELINE_SKIP} for what in ("defaults", "parity")]
            continue
        fp32 = ["--mixed-precision", "fp32"] if lab in FSDP_POLICY_LABS else []
        runs.append(lab_run(lab, "defaults", num_gpus, ["--steps", STEPS], out_dir))
        runs.append(lab_run(lab, "parity", num_gpus,
                            ["--steps", STEPS, "--check-parity", "--amp", "off", *fp32], out_dir))
    return runs


def plan_command(num_gpus, model):
    """lab02's --plan for this machine's GPU (no --gpu): prints "fits" or "does NOT fit"."""
    return [PYTHON, str(LABS_DIR / "lab02_fsdp.py"), "--plan", "--nproc", str(num_gpus),
            "--model", model, "--device", "cuda"]


def fill_run(num_gpus, model, out_dir):
    args = ["--model", model, "--steps", FILL_STEPS, "--log-every", 10]
    return lab_run("lab02_fsdp", "fill", num_gpus, args, out_dir, model=model)


def pytest_command():
    # tests/ only: the lessons are notebooks, none of them marked gpu
    return [PYTHON, "-m", "pytest", "-q", "-m", "gpu", "tests"]


# ---------------------------------------------------------------- running a command
def descendants(pid):
    """Every live process below pid, from /proc. torchrun starts each worker in a session of
    its own (elastic's SubprocessHandler: start_new_session=True), so killing torchrun's
    process group alone would leave the workers running, holding their GPUs."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # exited while we looked
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def kill_all(proc, everything):
    """everything (after a timeout): SIGKILL the command and every process below it. In every
    case SIGKILL what is left of its process group (a straggler of a finished command), then
    reap the command."""
    pids = [*descendants(proc.pid), proc.pid] if everything else []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):  # the group is gone: the normal case
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_command(cmd, timeout):
    """Run cmd in its own process group; past its timeout it is killed with everything below
    it (torchrun's workers would otherwise keep the GPUs from the next command). Output goes
    to a file, not a pipe, so a straggler cannot keep the call open. rc is None on timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a launch of our own, not a rank of the caller's job
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        proc = subprocess.Popen(list(map(str, cmd)), stdout=log, stderr=subprocess.STDOUT,
                                cwd=ROOT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        except BaseException:  # Ctrl-C: a new session does not get the terminal's SIGINT
            kill_all(proc, everything=True)
            raise
        kill_all(proc, everything=rc is None)
        log.seek(0)
        out = log.read()
    return {"rc": rc, "out": out, "wall_s": round(time.monotonic() - t0, 1)}


def shown(cmd):
    """A command as a reader can rerun it from the repo root: no venv, checkout or temp paths
    of this machine in a committed record."""
    tmp = tempfile.gettempdir()
    parts = []
    for part in map(str, cmd):
        if part == PYTHON:
            part = "python"
        elif part.startswith(f"{ROOT}/"):
            part = part[len(str(ROOT)) + 1:]
        elif part.startswith(f"{tmp}/"):
            part = "$TMPDIR/" + Path(part).name
        parts.append(part)
    return " ".join(parts)


def failure_reason(done, cmd, timeout):
    shown_cmd = shown(cmd)
    if done["rc"] is None:
        return f"timed out after {timeout:.0f} s: {shown_cmd}"
    return f"exit {done['rc']}: {shown_cmd}"


def precision_label(precision):
    """lab02 reports {"autocast": ..., "fsdp_params": ...}; the others one name."""
    if isinstance(precision, dict):
        names = sorted(set(precision.values()))
        return names[0] if len(names) == 1 else ", ".join(f"{k} {v}" for k, v in precision.items())
    return precision


def lab_result(run, done, timeout):
    """passed only if the lab exited 0, printed its "done | " line and wrote its metrics."""
    result = {"lab": run["lab"], "what": run["what"], "model": run["model"],
              "command": shown(run["cmd"]), "wall_s": done["wall_s"]}
    metrics_path = run["metrics"]
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else None
    said_done = any(line.startswith("done | ") for line in done["out"].splitlines())
    if done["rc"] != 0:
        return {**result, "status": "failed", "reason": failure_reason(done, run["cmd"], timeout)}
    if not (said_done and metrics):
        return {**result, "status": "failed",
                "reason": "exit 0 but no 'done | ' line or no metrics file"}
    return {**result, "status": "passed", "reason": None, "backend": metrics["backend"],
            "precision": precision_label(metrics["precision"]),
            "parity": metrics["parity_max_abs_diff"], "tokens_per_s": metrics["tokens_per_s"],
            "mfu": metrics["mfu"]}


# ---------------------------------------------------------------- pytest's verdict
def pytest_counts(out):
    """Counts from pytest's last summary line ("3 passed, 2 skipped, 10 deselected in 4.1s")."""
    summaries = [line for line in out.splitlines() if re.search(r"\bin [\d.]+s\b", line)
                 and re.search(r"\d+ (passed|failed|skipped|error|deselected)", line)]
    if not summaries:
        return {}
    found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)",
                       summaries[-1])
    return {word.rstrip("s") if word.startswith("error") else word: int(n) for n, word in found}


def pytest_result(done, cmd, timeout):
    counts = pytest_counts(done["out"])
    said = ", ".join(f"{n} {word}" for word, n in counts.items()) or "no summary line"
    result = {"lab": "tests", "what": "pytest -m gpu", "model": None, "counts": counts,
              "command": shown(cmd), "wall_s": done["wall_s"]}
    if done["rc"] != 0:
        return {**result, "status": "failed",
                "reason": f"{said}; {failure_reason(done, cmd, timeout)}"}
    if not counts.get("passed"):  # on a GPU the needs_cuda tests must run, not all skip
        return {**result, "status": "failed", "reason": f"{said}: no GPU test ran"}
    return {**result, "status": "passed", "reason": said}


# ---------------------------------------------------------------- the check
class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def budget(self, wanted):
        """Seconds a command may take now, or None when too little is left to start one."""
        left = self.end - time.monotonic()
        return min(wanted, left) if left >= MIN_START_S else None


def not_run(run, why):
    command = shown(run["cmd"]) if run.get("cmd") else None
    status = "skipped" if run.get("skip") else "failed"  # a stated skip; else it should have run
    return {"lab": run["lab"], "what": run["what"], "model": run.get("model"),
            "command": command, "status": status, "reason": why}


DEADLINE_REASON = f"not run: gpu-check's {DEADLINE_S} s deadline left no time"


def check_lab(run, deadline):
    if run["skip"]:
        return not_run(run, run["skip"])
    timeout = deadline.budget(RUN_TIMEOUT_S)
    if timeout is None:
        return not_run(run, DEADLINE_REASON)
    print(f">> {run['lab']} {run['what']}: {shown(run['cmd'])}", flush=True)
    done = run_command(run["cmd"], timeout)
    result = lab_result(run, done, timeout)
    if result["status"] == "failed":
        print("\n".join(done["out"].splitlines()[-25:]))  # the end of what it said
    return result


def check_tests(deadline):
    cmd = pytest_command()
    timeout = deadline.budget(PYTEST_TIMEOUT_S)
    if timeout is None:
        return not_run({"lab": "tests", "what": "pytest -m gpu", "cmd": cmd}, DEADLINE_REASON)
    print(f">> tests: {shown(cmd)}", flush=True)
    done = run_command(cmd, timeout)
    for line in done["out"].splitlines():  # pytest -ra: every skip and failure, with reasons
        if line.startswith(("SKIPPED", "FAILED", "ERROR")):
            print("   " + line)
    return pytest_result(done, cmd, timeout)


def choose_fill_model(num_gpus, deadline):
    """The first of FILL_MODELS whose plan fits this GPU, or (None, why not)."""
    for model in FILL_MODELS:
        timeout = deadline.budget(PLAN_TIMEOUT_S)
        if timeout is None:
            return None, DEADLINE_REASON
        done = run_command(plan_command(num_gpus, model), timeout)
        if done["rc"] != 0:
            return None, "--plan " + failure_reason(done, plan_command(num_gpus, model), timeout)
        if re.search(r"^\s+total\s.*: fits \(", done["out"], re.M):
            return model, None
    return None, f"--plan says none of {', '.join(FILL_MODELS)} fits"


def check_fill(num_gpus, out_dir, deadline):
    model, why_not = choose_fill_model(num_gpus, deadline)
    if model is None:
        return not_run({"lab": "lab02_fsdp", "what": "fill", "model": None}, why_not)
    return check_lab(fill_run(num_gpus, model, out_dir), deadline)


FACTS_CODE = """import json, torch
names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except (AttributeError, RuntimeError):  # a build without NCCL: the lab runs will say so
    nccl = "unavailable"
print(json.dumps({"device": " + ".join(names), "cuda": torch.version.cuda, "nccl": nccl}))
"""


def device_facts(num_gpus):
    """What ran on: the same facts for every result of this run. The names are asked in a
    child process: get_device_name goes through torch's CUDA initialisation, and this process
    is only a launcher that should hold nothing on the GPUs while the labs run."""
    done = run_command([PYTHON, "-c", FACTS_CODE], PLAN_TIMEOUT_S)
    if done["rc"] != 0:
        raise RuntimeError(f"gpu-check: could not read the GPUs' names:\n{done['out']}")
    now = datetime.datetime.now().astimezone()
    return {**json.loads(done["out"].splitlines()[-1]), "num_gpus": num_gpus,
            "torch": torch.__version__, "date": now.date().isoformat(),
            "run": now.isoformat(timespec="seconds")}


def print_table(results):
    print(f"\n{'lab':15s} {'what':14s} {'status':8s} {'precision':10s} {'parity':>8s} "
          f"{'tok/s':>10s} {'MFU':>6s}  reason")
    for r in results:
        parity = "" if r.get("parity") is None else f"{r['parity']:.1e}"
        tps = "" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.0f}"
        mfu = "" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        what = r["what"] + (f" ({r['model']})" if r["what"] == "fill" and r["model"] else "")
        print(f"{r['lab']:15s} {what:14s} {r['status'].upper():8s} {r.get('precision') or '':10s} "
              f"{parity:>8s} {tps:>10s} {mfu:>6s}  {r.get('reason') or ''}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labs", default="",
                        help="comma-separated lab names: run only their launches (no test tier, "
                             "no fill run), e.g. to recheck one lab after a fix")
    args = parser.parse_args(argv)
    args.labs = [name for name in args.labs.split(",") if name]
    unknown = sorted(set(args.labs) - set(LABS))
    if unknown:
        parser.error(f"--labs: unknown {', '.join(unknown)}; known: {', '.join(LABS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 1
    num_gpus = torch.cuda.device_count()
    facts = device_facts(num_gpus)
    print(f"gpu-check: {num_gpus} x {facts['device']}, torch {facts['torch']}, CUDA "
          f"{facts['cuda']}, NCCL {facts['nccl']}; deadline {DEADLINE_S} s", flush=True)
    deadline, results = Deadline(DEADLINE_S), []

    def record(result):
        entry = {**result, **facts}
        verified.record_gpu_check(entry)  # as it happens: a crash later keeps what ran
        results.append(entry)
        print(f">> {entry['lab']} {entry['what']}: {entry['status'].upper()}"
              f"{': ' + entry['reason'] if entry.get('reason') else ''}", flush=True)

    with tempfile.TemporaryDirectory() as out_dir:
        for run in planned_runs(num_gpus, out_dir):
            if not args.labs or run["lab"] in args.labs:
                record(check_lab(run, deadline))
        if not args.labs:
            record(check_tests(deadline))
            record(check_fill(num_gpus, out_dir, deadline))
    print_table(results)
    ok = all(r["status"] != "failed" for r in results)
    print(f"\ngpu-check: {'all that ran passed' if ok else 'FAILED'}; results appended to "
          f"{verified.GPU_RECORDS} (commit it: the pages' GPU stamps read it)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
