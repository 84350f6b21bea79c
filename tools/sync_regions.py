"""Copy the shared regions of labs/lab01_ddp.py into every other lab.

Labs are copied alone by learners, so the shared code (cli, setup, model, data, metrics, faults)
is duplicated on purpose; edit it in lab01, run this, and tests/test_shared_regions.py stays
green. Usage: python tools/sync_regions.py [--check]
"""

import re
import sys
from pathlib import Path

LABS = Path(__file__).resolve().parents[1] / "labs"
REGION = re.compile(r"^# --8<-- \[start:(\w+)\]\n.*?^# --8<-- \[end:\1\]\n", re.S | re.M)


def synced(text, source_regions):
    return REGION.sub(lambda m: source_regions.get(m.group(1), m.group(0)), text)


def main():
    source = (LABS / "lab01_ddp.py").read_text()
    regions = {m.group(1): m.group(0) for m in REGION.finditer(source)}
    stale = []
    for lab in sorted(LABS.glob("lab[0-9][0-9]_*.py")):
        text = lab.read_text()
        new = synced(text, regions)
        if new != text:
            stale.append(lab.name)
            if "--check" not in sys.argv:
                lab.write_text(new)
    verb = "out of date" if "--check" in sys.argv else "updated"
    print(f"{verb}: {', '.join(stale) or 'none'}")
    return 1 if stale and "--check" in sys.argv else 0


if __name__ == "__main__":
    sys.exit(main())
