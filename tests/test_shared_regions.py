"""Labs are copied alone, so setup/model/data/metrics/main are duplicated on purpose. This keeps the
copies identical: one edit, every lab updated, or this test fails naming the region and lab."""

import re
from pathlib import Path

import pytest

LABS = Path(__file__).resolve().parents[1] / "labs"
REGION = re.compile(r"^# --8<-- \[start:(\w+)\]\n(.*?)^# --8<-- \[end:\1\]\n", re.S | re.M)
REQUIRED = {"cli", "setup", "model", "data", "metrics", "faults", "schedule", "main"}
MESH_LABS = {"lab02_fsdp", "lab03_tp_fsdp", "lab04_pipeline", "lab05_3d",
             "lab07_context_parallel", "lab08_expert_parallel"}  # the labs that build a mesh
DCP_LABS = MESH_LABS  # the labs that checkpoint with torch.distributed.checkpoint


def regions(path):
    return {name: body for name, body in REGION.findall(path.read_text())}


def region_mismatches(lab_paths):
    """(region, lab) pairs whose copy differs from the first copy of that region (in lab order:
    a region that only some labs need, like the mesh, is compared among those)."""
    first, mismatches = {}, []
    for lab in lab_paths:
        for name, body in regions(lab).items():
            if first.setdefault(name, body) != body:
                mismatches.append((name, lab.name))
    return mismatches


def lab_paths():
    return sorted(LABS.glob("lab[0-9][0-9]_*.py"))


@pytest.mark.parametrize("lab", lab_paths(), ids=lambda p: p.stem)
def test_every_lab_has_every_shared_region(lab):
    assert REQUIRED <= set(regions(lab)), f"missing: {REQUIRED - set(regions(lab))}"


def test_shared_regions_are_identical_in_every_lab():
    assert region_mismatches(lab_paths()) == []


@pytest.mark.parametrize("lab", lab_paths(), ids=lambda p: p.stem)
def test_every_lab_with_a_mesh_builds_it_in_the_shared_region(lab):
    """init_device_mesh's sub-groups ignore --timeout-s (torch 2.13); init_mesh() does not."""
    source = lab.read_text()
    assert ("mesh" in regions(lab)) == (lab.stem in MESH_LABS)
    assert "init_device_mesh(" not in source


@pytest.mark.parametrize("lab", lab_paths(), ids=lambda p: p.stem)
def test_every_dcp_lab_commits_its_checkpoints_in_the_shared_region(lab):
    """The tmp-then-rename protocol lives in one region, so the fault-tolerance runs of one DCP
    lab (tests/test_fault_tolerance_labs.py) exercise every lab's copy of it."""
    held = regions(lab)
    assert ("checkpoint" in held) == (lab.stem in DCP_LABS)
    if lab.stem in DCP_LABS:
        assert "dcp.save(" not in lab.read_text().replace(held["checkpoint"], "")


def test_the_check_catches_a_drifted_mesh_region(tmp_path):
    labs = [LABS / f"{name}.py" for name in sorted(MESH_LABS)]
    drifted = tmp_path / "lab99_drift.py"
    drifted.write_text(labs[0].read_text().replace("group_desc=f\"mesh_{name}\"", "group_desc=name"))
    assert region_mismatches([*labs, drifted]) == [("mesh", "lab99_drift.py")]


def test_the_check_catches_a_drifted_copy(tmp_path):
    original = lab_paths()[0]
    drifted = tmp_path / "lab99_drift.py"
    drifted.write_text(original.read_text().replace("def free_port():", "def free_port():  # x"))
    assert region_mismatches([original, drifted]) == [("setup", "lab99_drift.py")]
