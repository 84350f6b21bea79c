"""The labs not yet on the kit (labs/labkit/) are copied alone, so they carry setup, model,
data, metrics and main themselves. This keeps those copies identical: one edit, every such lab
updated (tools/sync_regions.py), or this test fails naming the region and lab. It retires with
the last lab that moves to the kit; the kit's own rules are in tests/test_lab_copy.py."""

import ast
import re
import sys
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
    """The labs not yet on the kit (labs/labkit/), which still carry the regions."""
    import lessons

    return lessons.self_contained_lab_paths()


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
    labs = [lab for lab in lab_paths() if lab.stem in MESH_LABS]
    drifted = tmp_path / "lab99_drift.py"
    drifted.write_text(labs[0].read_text().replace("group_desc=f\"mesh_{name}\"", "group_desc=name"))
    assert region_mismatches([*labs, drifted]) == [("mesh", "lab99_drift.py")]


def test_the_check_catches_a_drifted_copy(tmp_path):
    original = lab_paths()[0]
    drifted = tmp_path / "lab99_drift.py"
    drifted.write_text(original.read_text().replace("def free_port():", "def free_port():  # x"))
    assert region_mismatches([original, drifted]) == [("setup", "lab99_drift.py")]


def function_source(path, name):
    match = re.search(rf"^def {name}\(.*?(?=^\S)", path.read_text(), re.S | re.M)
    assert match, f"{path.name} has no top-level def {name}"
    return match.group(0)


def test_perf_models_matmul_peak_is_the_labs():
    """labs/perf_model.py may import only torch, so it carries its own copy of the labs'
    measure_matmul_peak; the copy must not drift from the one the labs' MFU uses."""
    copy = function_source(LABS / "perf_model.py", "measure_matmul_peak")
    for lab in [LABS / "labkit" / "metrics.py", *lab_paths()]:
        assert function_source(lab, "measure_matmul_peak") == copy, lab.name


def test_the_labs_folder_imports_only_the_standard_library_and_torch():
    """Every module in labs/ runs when copied alone (a lab on the kit: with labs/labkit/) with
    only torch installed: no import of a sibling lab or tool, at the top or inside a function."""
    siblings = {p.stem for p in LABS.glob("*.py")}
    for path in sorted(LABS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in siblings, f"{path.name} imports {name}"
                assert top in sys.stdlib_module_names or top in ("torch", "labkit"), \
                    f"{path.name} imports {name}"
