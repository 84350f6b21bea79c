"""A lab is copied into a project as its file plus the kit folder beside it (labs/labkit/).
This does exactly that: each lab and the kit, alone in an empty folder outside the repository,
run there under torchrun at 2 ranks with --check-parity, with nothing of the repository on the
path. And what they import is the standard library, torch and the kit: nothing else."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from launcher import LABS, launch_failed, torchrun_cmd

LAB_PATHS = sorted(LABS.glob("lab[0-9][0-9]_*.py"))
KIT = LABS / "labkit"


def imported_packages(path):
    """The top-level names of every absolute import in a Python file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_labs_and_kit_import_only_the_standard_library_torch_and_the_kit():
    files = [*sorted(LABS.glob("*.py")), *sorted(KIT.glob("*.py"))]  # perf_model.py too
    assert len(files) > len(LAB_PATHS) + 5, files  # the kit is there, one module per concern
    for path in files:
        others = imported_packages(path) - sys.stdlib_module_names - {"torch", "labkit"}
        assert not others, f"{path.relative_to(LABS)} imports {sorted(others)}"


@pytest.mark.parametrize("lab_path", LAB_PATHS, ids=lambda p: p.stem)
def test_a_copied_lab_trains_with_parity_from_an_empty_folder(lab_path, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(lab_path, project)
    shutil.copytree(KIT, project / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    # Mark the copied kit, so the run proves it imported this copy and no other.
    with open(project / "labkit" / "__init__.py", "a") as init:
        init.write("\n__import__('pathlib').Path(__file__).with_name('imported-here').touch()\n")
    metrics_path = project / "metrics.json"
    cmd = torchrun_cmd(project / lab_path.name, 2, ["--check-parity", "--steps", "8",
                                                    "--metrics-out", metrics_path])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    proc = subprocess.run(cmd, cwd=project, env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise launch_failed(proc)
    metrics = json.loads(metrics_path.read_text())
    assert metrics["lab"] == lab_path.stem and metrics["world_size"] == 2
    assert metrics["parity_max_abs_diff"] <= 1e-5, metrics["parity_max_abs_diff"]
    assert str(LABS) not in proc.stdout + proc.stderr  # nothing ran from the repository
    if "\nfrom labkit." in lab_path.read_text():
        assert (project / "labkit" / "imported-here").exists()


def function_source(path, name):
    match = re.search(rf"^def {name}\(.*?(?=^\S)", path.read_text(), re.S | re.M)
    assert match, f"{path.name} has no top-level def {name}"
    return match.group(0)


def test_perf_models_matmul_peak_is_the_kits():
    """labs/perf_model.py may import only torch, so it carries its own copy of the kit's
    measure_matmul_peak; the copy must not drift from the one the labs' MFU uses."""
    assert (function_source(LABS / "perf_model.py", "measure_matmul_peak")
            == function_source(KIT / "metrics.py", "measure_matmul_peak"))
