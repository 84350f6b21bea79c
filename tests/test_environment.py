"""pyproject.toml's dependency groups, requirements.lock, the conda environment and the code's
imports tell one story."""

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
GROUPS = PYPROJECT["dependency-groups"]


def group(name):
    """A dependency group's requirements, its included groups expanded (PEP 735)."""
    reqs = []
    for entry in GROUPS[name]:
        reqs += group(entry["include-group"]) if isinstance(entry, dict) else [Requirement(entry)]
    return reqs


def lock_pins(path=REPO / "requirements.lock"):
    """{normalised name: version} of a uv-compiled lock (`name==version` lines)."""
    pins = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", " ", "-")):
            req = Requirement(line)
            (pin,) = req.specifier
            assert pin.operator == "==", line
            pins[canonicalize_name(req.name)] = pin.version
    return pins


def conda_env():
    return yaml.safe_load((REPO / "environment.yml").read_text())


def test_the_groups_nest_learner_in_site_in_test():
    names = lambda g: {canonicalize_name(r.name) for r in group(g)}  # noqa: E731
    assert names("learner") < names("site") < names("test")
    assert "torch" in names("learner") and "mkdocs" not in names("learner")
    assert "pytest" not in names("site")


def test_environment_yml_pip_section_equals_the_test_group():
    deps = conda_env()["dependencies"]
    pip_section = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    as_set = lambda reqs: {str(Requirement(str(r))) for r in reqs}  # noqa: E731 (normalised)
    assert as_set(pip_section) == as_set(group("test"))


def test_environment_yml_is_conda_forge_python_311():
    env = conda_env()
    assert env["channels"] == ["conda-forge"]
    assert "python=3.11" in env["dependencies"] and "pip" in env["dependencies"]


def test_the_lock_pins_ci_torch_and_every_requirement_inside_its_range():
    pins = lock_pins()
    assert pins["torch"] == "2.13.0+cpu"  # the CPU wheel CI runs
    for req in group("test"):
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is required but requirements.lock does not pin it"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} outside {req}"


def test_mkdocs_is_capped_below_2_and_the_docs_stack_pinned():
    (mkdocs,) = [r for r in group("site") if r.name == "mkdocs"]
    assert not mkdocs.specifier.contains("2.0") and mkdocs.specifier.contains("1.6.1")
    pins = lock_pins()
    assert (pins["mkdocs"], pins["mkdocs-material"]) == ("1.6.1", "9.8.1")


def python_files():
    return subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.split()


def imported_top_level_names():
    """{top-level module: first file importing it} over the repository's Python files."""
    names = {}
    for file in python_files():
        for node in ast.walk(ast.parse((REPO / file).read_text(), file)):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = [node.module]
            else:
                continue
            for name in found:
                names.setdefault(name.split(".")[0], file)
    return names


def test_every_imported_package_is_declared():
    """A module the code imports is the standard library's, the repository's own (a file or
    folder of that name), or comes from a distribution that a dependency group declares."""
    files = [Path(file) for file in python_files()]
    own = {f.stem for f in files} | {folder.name for f in files for folder in f.parents}
    declared = {canonicalize_name(r.name) for r in group("test")}
    providers = importlib.metadata.packages_distributions()
    undeclared = []
    for module, file in sorted(imported_top_level_names().items()):
        if module in sys.stdlib_module_names or module in own or module == "__future__":
            continue
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if not dists & declared:
            undeclared.append(f"{module} ({file}; from {sorted(dists) or 'no installed package'})")
    assert not undeclared, "imported but declared in no group: " + ", ".join(undeclared)


def test_the_environment_running_the_tests_is_the_lock():
    """`make test` installs the test group as requirements.lock pins it; `make test LOCK=` (your
    own torch build) does not, and says so by an empty COURSE_LOCK."""
    if os.environ.get("COURSE_LOCK", "requirements.lock") == "":
        pytest.skip("make test LOCK=: this environment follows pyproject.toml's ranges, not the lock")
    installed = {canonicalize_name(d.metadata["Name"]): d.version
                 for d in importlib.metadata.distributions()}
    differ = {name: (version, installed.get(name)) for name, version in lock_pins().items()
              if installed.get(name) != version}
    assert not differ, f"pinned, installed: {differ}"


def find_links():
    """Where this machine's pip finds the CPU torch wheel, if it is configured to."""
    configured = os.environ.get("PIP_FIND_LINKS") or subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True, text=True).stdout.strip()
    return configured.split()[0] if configured else None


def test_make_lock_reproduces_the_lock(tmp_path):
    """requirements.lock is what `make lock` makes from pyproject.toml today: a group changed
    without re-locking fails here. uv resolves against the package index (network)."""
    out = tmp_path / "requirements.lock"
    shutil.copy(REPO / "requirements.lock", out)
    wheels = [f"TORCH_WHEELS={find_links()}"] if find_links() else []
    proc = subprocess.run(["make", "--no-print-directory", "lock", f"PY={sys.executable}",
                           f"LOCK_OUT={out}", *wheels], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.read_text() == (REPO / "requirements.lock").read_text()


def test_ci_runs_exactly_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    commands = [line for line in ci.splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert commands == ["make test"]
    assert re.search(r"^make test\b", readme, re.M)


def test_the_suite_finds_installed_files_from_a_venv_outside_the_repo(tmp_path):
    """A clean clone has no .venv: the tests that read torch's headers and run py-spy must find
    them through the running interpreter, as they do for an active venv or conda env."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)],
                   check=True, timeout=120)
    assert not (clone / ".venv").exists() and not str(sys.prefix).startswith(str(clone))
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import launcher; "
                               "print(launcher.installed_script('py-spy'))"],
        cwd=clone, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).exists(), probe.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q",
         "tests/test_runbook_oom.py::test_installed_headers_say_what_the_page_quotes"],
        cwd=clone, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr
