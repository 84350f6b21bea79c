"""Lessons open in a real Jupyter server as notebooks, and the publishing workflow is sound.

The Jupyter test starts the README's `jupyter lab lessons/` from the project environment and
asks its contents API for every lesson `.py` as a notebook, as JupyterLab does when you open
one: Jupytext's contents manager must turn the py:percent file into cells.
"""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from launcher import REPO, free_port

LESSONS = sorted((REPO / "lessons").glob("[0-9][0-9]_*.py"))
TOKEN = "course-test-token"


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    port = free_port()
    runtime = tmp_path_factory.mktemp("jupyter-runtime")
    log = (runtime / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "lessons/", "--no-browser", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}",
         "--ServerApp.port_retries=0",
         *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI containers run as root
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO,  # the README's `jupyter lab lessons/`
        env={**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime)})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            get(f"{base}/api/status")
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("jupyter server did not start within 90 s:\n"
                            + (runtime / "server.log").read_text()[-3000:])
            time.sleep(0.5)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def get(url):
    request = urllib.request.Request(url, headers={"Authorization": f"token {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.name)
def test_jupyter_opens_each_lesson_as_a_notebook(jupyter, lesson):
    model = get(f"{jupyter}/api/contents/{lesson.name}?type=notebook&content=1")
    assert model["type"] == "notebook", model["type"]
    cells = model["content"]["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    markdown = [c for c in cells if c["cell_type"] == "markdown"]
    assert len(code) >= 5 and len(markdown) >= 5, (len(code), len(markdown))
    assert markdown[0]["source"].startswith("# "), markdown[0]["source"][:80]  # the title
    # Every cell of the .py file arrives as a cell, in order: compare with jupytext itself.
    import jupytext
    expected = jupytext.read(lesson)
    assert [c["source"] for c in cells] == [c["source"] for c in expected.cells]


def test_pages_workflow_builds_with_the_readme_command_and_deploys_site():
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "pages.yml").read_text())
    triggers = workflow[True]  # YAML 1.1 reads the bare key `on` as True
    assert triggers["push"]["branches"] == ["main"]
    assert workflow["permissions"] == {"contents": "read", "pages": "write", "id-token": "write"}
    build, deploy = workflow["jobs"]["build"], workflow["jobs"]["deploy"]
    runs = [step["run"] for step in build["steps"] if "run" in step]
    assert runs == ["make course"]
    assert "make course" in (REPO / "README.md").read_text()
    mkdocs_site_dir = yaml.safe_load((REPO / "mkdocs.yml").read_text())["site_dir"]
    upload = next(s for s in build["steps"] if s.get("uses", "").startswith(
        "actions/upload-pages-artifact@"))
    assert upload["with"]["path"] == mkdocs_site_dir
    assert deploy["needs"] == "build"
    assert deploy["environment"]["name"] == "github-pages"
    assert any(s.get("uses", "").startswith("actions/deploy-pages@") for s in deploy["steps"])
