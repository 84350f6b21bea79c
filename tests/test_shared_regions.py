"""Labs are copied alone, so setup/model/data/metrics/main are duplicated on purpose. This keeps the
copies identical: one edit, every lab updated, or this test fails naming the region and lab."""

import re
from pathlib import Path

import pytest

LABS = Path(__file__).resolve().parents[1] / "labs"
REGION = re.compile(r"^# --8<-- \[start:(\w+)\]\n(.*?)^# --8<-- \[end:\1\]\n", re.S | re.M)
REQUIRED = {"cli", "setup", "model", "data", "metrics", "faults", "main"}


def regions(path):
    return {name: body for name, body in REGION.findall(path.read_text())}


def region_mismatches(lab_paths):
    """(region, lab) pairs whose copy differs from the first lab's."""
    reference = regions(lab_paths[0])
    return [(name, lab.name) for lab in lab_paths[1:]
            for name, body in regions(lab).items() if name in reference and body != reference[name]]


def lab_paths():
    return sorted(LABS.glob("lab[0-9][0-9]_*.py"))


@pytest.mark.parametrize("lab", lab_paths(), ids=lambda p: p.stem)
def test_every_lab_has_every_shared_region(lab):
    assert REQUIRED <= set(regions(lab)), f"missing: {REQUIRED - set(regions(lab))}"


def test_shared_regions_are_identical_in_every_lab():
    assert region_mismatches(lab_paths()) == []


def test_the_check_catches_a_drifted_copy(tmp_path):
    original = lab_paths()[0]
    drifted = tmp_path / "lab99_drift.py"
    drifted.write_text(original.read_text().replace("def free_port():", "def free_port():  # x"))
    assert region_mismatches([original, drifted]) == [("setup", "lab99_drift.py")]
