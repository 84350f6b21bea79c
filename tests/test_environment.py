"""The pip requirements, the conda environment and the CI pins tell one story."""

import re
import subprocess
import sys
from pathlib import Path

import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def requirement_lines(path):
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def conda_env():
    return yaml.safe_load((REPO / "environment.yml").read_text())


def test_environment_yml_pip_section_equals_requirements():
    deps = conda_env()["dependencies"]
    pip_section = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    as_set = lambda reqs: {str(Requirement(r)) for r in reqs}  # noqa: E731 (normalised)
    assert as_set(pip_section) == as_set(requirement_lines(REPO / "requirements.txt"))


def test_environment_yml_is_conda_forge_python_311():
    env = conda_env()
    assert env["channels"] == ["conda-forge"]
    assert "python=3.11" in env["dependencies"] and "pip" in env["dependencies"]


def test_constraints_pin_ci_torch_and_sit_inside_the_supported_ranges():
    requirements = {Requirement(r).name: Requirement(r)
                    for r in requirement_lines(REPO / "requirements.txt")}
    pins = [Requirement(r) for r in requirement_lines(REPO / "constraints.txt")]
    assert "torch==2.13.0" in {str(p) for p in pins}
    assert str(requirements["torch"].specifier) == ">=2.6"
    for pin in pins:
        (version,) = [s.version for s in pin.specifier if s.operator == "=="]
        assert pin.name in requirements, f"{pin.name} is pinned but not required"
        assert requirements[pin.name].specifier.contains(version), f"{pin} outside range"


def test_mkdocs_is_capped_below_2():
    (mkdocs,) = [Requirement(r) for r in requirement_lines(REPO / "requirements.txt")
                 if r.startswith("mkdocs>")]
    assert not mkdocs.specifier.contains("2.0") and mkdocs.specifier.contains("1.6.1")


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
