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
