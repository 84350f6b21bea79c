"""Copy each shared region from the first lab that holds it into every other lab.

The labs not yet on the kit (labs/labkit/) are copied alone, so they carry the shared code (cli,
setup, model, data, metrics, faults, ...) themselves. Edit a region in the first such lab that
has it (lab05 now), run this, and tests/test_shared_regions.py stays green. It retires with the
last lab that moves to the kit. Usage: python tools/sync_regions.py [--check]
"""

import re
import sys
from pathlib import Path

import lessons  # tools/lessons.py: which labs are still self-contained

REGION = re.compile(r"^# --8<-- \[start:(\w+)\]\n.*?^# --8<-- \[end:\1\]\n", re.S | re.M)


def synced(text, source_regions):
    return REGION.sub(lambda m: source_regions.get(m.group(1), m.group(0)), text)


def main():
    regions = {}
    for lab in lessons.self_contained_lab_paths():
        for m in REGION.finditer(lab.read_text()):
            regions.setdefault(m.group(1), m.group(0))
    stale = []
    for lab in lessons.self_contained_lab_paths():
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
