"""'Verified on' stamps: what ran, on what, when. Recorded by the runs themselves, never typed.

Labs: every successful lab launch by the tests (tests/launcher.py) or by `make course` appends
its facts to build/verified/labs.jsonl. Lessons: the run that executed a notebook writes its
facts into that notebook's metadata, next to the outputs the site shows.
"""

import datetime
import json
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAB_RECORDS = ROOT / "build" / "verified" / "labs.jsonl"


def today():
    return datetime.date.today().isoformat()


def record_lab_run(metrics, source):
    """Append one successful lab run, described by its own metrics JSON."""
    entry = {key: metrics[key] for key in ("lab", "device", "backend", "world_size")}
    entry.update(torch=metrics["torch_version"], parity=metrics.get("parity_max_abs_diff"),
                 date=today(), source=source)
    LAB_RECORDS.parent.mkdir(parents=True, exist_ok=True)
    with LAB_RECORDS.open("a") as records:  # one short line per append: no torn records
        records.write(json.dumps(entry) + "\n")


def lab_records(lab):
    if not LAB_RECORDS.exists():
        return []
    entries = (json.loads(line) for line in LAB_RECORDS.read_text().splitlines() if line)
    return [entry for entry in entries if entry["lab"] == lab]


def lab_stamp(lab):
    """One sentence for the lab's page, from the newest day's records, or None."""
    entries = lab_records(lab)
    if not entries:
        return None
    day = max(entry["date"] for entry in entries)
    entries = [entry for entry in entries if entry["date"] == day]
    setups = sorted({f"torch {e['torch']}, {e['device']} ({e['backend']})" for e in entries})
    sizes = ", ".join(str(n) for n in sorted({e["world_size"] for e in entries}))
    parities = [e["parity"] for e in entries if e["parity"] is not None]
    sources = " and ".join(sorted({e["source"] for e in entries}))
    stamp = (f"Verified on {day} by {sources}: {'; '.join(setups)}; world sizes {sizes}; "
             f"{len(entries)} successful runs")
    if parities:
        stamp += f"; largest parity difference {max(parities):.1e}"
    return stamp + "."


def lesson_facts(source):
    import torch

    return {"date": today(), "torch": torch.__version__, "python": platform.python_version(),
            "device": "cuda" if torch.cuda.is_available() else "cpu", "source": source}


def lesson_stamp(facts):
    return (f"Executed on {facts['date']} by {facts['source']}: torch {facts['torch']}, "
            f"Python {facts['python']}, {facts['device']}. The outputs on this page come from "
            f"that run.")


# GPU runs: `make gpu-check` (tools/gpu_check.py) appends one line per result to a committed
# file, since no CI machine has a GPU: the record of a GPU run is kept with the code it ran.
GPU_RECORDS = ROOT / "verified" / "gpu-check.jsonl"


def record_gpu_check(entry, path=None):
    path = Path(path or GPU_RECORDS)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as records:  # one short line per append: no torn records
        records.write(json.dumps(entry) + "\n")


def gpu_records(lab, path=None):
    path = Path(path or GPU_RECORDS)
    if not path.exists():
        return []
    entries = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return [entry for entry in entries if entry["lab"] == lab]


def gpu_figures(passed):
    """"parity 1.2e-06 (fp32), 123456 tok/s at 41.2% MFU (bf16, --model 1b)" from passed
    results; the throughput of the run that fills the GPU when there is one."""
    figures = [f"parity {e['parity']:.1e} (fp32)" for e in passed
               if e["what"] == "parity" and e.get("parity") is not None]
    speed = ([e for e in passed if e["what"] == "fill"] or
             [e for e in passed if e["what"] == "defaults"])
    if speed and speed[0].get("tokens_per_s") is not None:
        e = speed[0]
        mfu = "n/a" if e.get("mfu") is None else f"{e['mfu']:.1%}"
        figures.append(f"{e['tokens_per_s']:.0f} tok/s at {mfu} MFU "
                       f"({e['precision']}, --model {e['model']})")
    return figures


def gpu_not_passed(entries):
    """["defaults and parity skipped: the pipeline lab needs >= 2 GPUs", ...]: one phrase per
    status and reason, so a skip of both runs is said once."""
    whats = {}
    for e in entries:
        if e["status"] != "passed":
            whats.setdefault((e["status"], e["reason"]), []).append(e["what"])
    return [f"{' and '.join(names)} {status}: {reason}" for (status, reason), names in whats.items()]


def gpu_stamp(lab, path=None):
    """One sentence for the lab's page from the newest `make gpu-check` run that has this lab,
    or None when none has. Only passed results are called verified; a skip or a failure in
    that run is said, with its reason, never hidden behind an older pass."""
    entries = gpu_records(lab, path)
    if not entries:
        return None
    newest = max(entry["run"] for entry in entries)
    entries = [entry for entry in entries if entry["run"] == newest]
    e = entries[0]
    setup = (f"{e['num_gpus']} x {e['device']}, torch {e['torch']}, CUDA {e['cuda']}, "
             f"NCCL {e['nccl']}")
    passed = [entry for entry in entries if entry["status"] == "passed"]
    others = gpu_not_passed(entries)
    if not passed:
        return f"GPU: not verified by make gpu-check on {e['date']} on {setup}: {'; '.join(others)}."
    stamp = f"GPU: verified on {e['date']} by make gpu-check on {setup}"
    figures = gpu_figures(passed)
    stamp += (": " + ", ".join(figures)) if figures else ""
    return stamp + "".join(f"; {other}" for other in others) + "."
