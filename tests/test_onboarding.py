"""docs/onboarding.md: the path covers every lesson and runbook, and every exercise's worked
answer passes its self-check while a typical wrong answer fails it.

Page convention (see the page source):
- ```python title="self-check N.M"```       the check the learner's answer must pass;
- ```python title="answer N.M"```           the worked answer (indented, inside `??? note`);
- ```bash title="run N.M"```                optional: a lab run whose output the check reads;
- <!-- wrong-answer N.M ... -->             a wrong answer the check must reject.
Lab runs write under /tmp/onboarding/; the test points that at its own temporary directory.
"""

import os
import re
import subprocess
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from launcher import PYTHON, REPO

PAGE = REPO / "docs" / "onboarding.md"
OUT = "/tmp/onboarding"
BLOCK = re.compile(r'^( *)```(\w+) title="(self-check|answer|run) (\d+\.\d+)"\n(.*?)^\1```',
                   re.M | re.S)
WRONG = re.compile(r"^<!-- wrong-answer (\d+\.\d+)\n(.*?)^-->", re.M | re.S)
CHECK_TIMEOUT_S = 120
RUN_TIMEOUT_S = 300


def parse_exercises(text):
    exercises = {}
    for indent, _lang, kind, ex_id, body in BLOCK.findall(text):
        code = textwrap.dedent("\n".join(line[len(indent):] if line.startswith(indent) else line
                                          for line in body.splitlines()))
        entry = exercises.setdefault(ex_id, {"run": []})
        if kind == "run":
            entry["run"].append(code)
        else:
            assert kind not in entry, f"two {kind} blocks for exercise {ex_id}"
            entry[kind] = code
    for ex_id, code in WRONG.findall(text):
        exercises.setdefault(ex_id, {"run": []})["wrong"] = code
    return exercises


EXERCISES = parse_exercises(PAGE.read_text())


def env_for(out_dir):
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(PYTHON).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def run_python(code, out_dir):
    """Run code in a fresh interpreter at the repo root, as the page tells the learner to."""
    return subprocess.run([PYTHON, "-c", code.replace(OUT, str(out_dir))], cwd=REPO,
                          env=env_for(out_dir), capture_output=True, text=True,
                          timeout=CHECK_TIMEOUT_S)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    """Run every `run` block once (the lab launches), shared by the checks that read them."""
    out = tmp_path_factory.mktemp("onboarding")
    for ex_id, exercise in sorted(EXERCISES.items()):
        for script in exercise["run"]:
            script = re.sub(r"\\\n\s*", " ", script).replace(OUT, str(out))
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO,
                                  env=env_for(out), capture_output=True, text=True,
                                  timeout=RUN_TIMEOUT_S)
            assert proc.returncode == 0, f"run {ex_id} failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_page_parses_into_complete_exercises():
    by_lesson = {}
    for ex_id, exercise in EXERCISES.items():
        missing = {"self-check", "answer", "wrong"} - set(exercise)
        assert not missing, f"exercise {ex_id} lacks {missing}"
        by_lesson.setdefault(int(ex_id.split(".")[0]), []).append(ex_id)
    lessons = sorted(int(p.name[:2]) for p in (REPO / "lessons").glob("[0-9][0-9]_*.py"))
    assert sorted(by_lesson) == lessons, "every lesson needs exercises, and only lessons"
    assert all(2 <= len(ids) <= 3 for ids in by_lesson.values()), by_lesson
    text = PAGE.read_text()
    hand_ins = re.findall(r"Hand in\s+exercises?\s+([0-9.,\sand]+)", text)
    handed_in = re.findall(r"\d+\.\d+", " ".join(hand_ins))
    assert sorted(handed_in) == sorted(EXERCISES), "the path hands in every exercise, once"
    launches = sum(s.count("torchrun ") for e in EXERCISES.values() for s in e["run"])
    assert launches <= 2, "keep the test to at most 2 torchrun launches"


def test_path_covers_every_lesson_lab_and_runbook():
    text = PAGE.read_text()
    for lesson in sorted((REPO / "lessons").glob("[0-9][0-9]_*.py")):
        assert f"](lessons/{lesson.stem}.ipynb)" in text, lesson.name
    for lab in sorted((REPO / "labs").glob("lab[0-9][0-9]_*.py")):
        assert f"](labs/{lab.stem}.md)" in text, lab.name
    for page in sorted((REPO / "runbooks").glob("*.md")):
        if page.name != "index.md":
            assert f"](runbooks/{page.name})" in text, page.name
    drills = {p.name for p in (REPO / "runbooks" / "drills").glob("*.py")}
    named = set(re.findall(r"runbooks/drills/(\w+\.py)", text))
    assert named <= drills, named - drills
    cpu_drills = {d for d in drills if "cuda" not in d}  # the CUDA drill needs a GPU
    assert cpu_drills <= named, f"drills missing from the path: {cpu_drills - named}"


def test_timings_table_is_filled_and_sourced():
    text = PAGE.read_text()
    rows = re.findall(r"^\| (.+?) \| `(.+?)` \| (\d+) s \|$", text, re.M)
    assert len(rows) >= 10, "the timing table lists the labs, two lessons and the drills"
    table = text.split("| what | command | measured |\n|---|---|---|\n", 1)[1].split("\n\n")[0]
    unfilled = [row for row in table.splitlines()
                if not re.fullmatch(r"\| (.+?) \| `(.+?)` \| (\d+) s \|", row)]
    assert not unfilled, f"timing rows without a measured figure: {unfilled}"
    assert "torch 2.13" in text and "2-core" in text  # where the numbers come from


@pytest.mark.parametrize("ex_id", sorted(EXERCISES))
def test_worked_answer_passes_and_wrong_answer_fails(ex_id, out_dir):
    exercise = EXERCISES[ex_id]
    with ThreadPoolExecutor(2) as pool:  # two fresh interpreters side by side
        good, bad = pool.map(lambda answer: run_python(answer + "\n" + exercise["self-check"],
                                                       out_dir),
                             [exercise["answer"], exercise["wrong"]])
    assert good.returncode == 0, f"worked answer {ex_id} fails its check:\n{good.stderr}"
    assert bad.returncode != 0, f"self-check {ex_id} accepts the wrong answer"
    # The check itself must reject it, not a crash in the wrong answer's code.
    assert "AssertionError" in bad.stderr, bad.stderr
