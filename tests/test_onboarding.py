"""The onboarding pages: the plan (docs/onboarding.md) covers every lesson and runbook and hands
in every exercise; in the exercise book (docs/onboarding-exercises.md) every worked answer
passes its self-check while a typical wrong answer, and the self-check pasted as the answer,
fail it.

Exercise book convention (see the page source):
- ```python title="self-check N.M"```       the check the learner's answer must pass;
- ```python title="answer N.M"```           the worked answer (indented, inside `??? note`);
- ```bash title="run N.M"```                optional: a lab run whose output the check reads;
- <!-- wrong-answer N.M ... -->             a wrong answer the check must reject.
Lab runs write under /tmp/onboarding/; the test points that at its own temporary directory.
"""

import ast
import builtins
import os
import re
import subprocess
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from launcher import PYTHON, REPO

import onboarding_week as week  # tools/onboarding_week.py (conftest puts tools/ on the path)

PLAN = REPO / "docs" / "onboarding.md"
BOOK = REPO / "docs" / "onboarding-exercises.md"
RUBRIC = REPO / "docs" / "onboarding-rubric.md"
SELFCHECK = REPO / "exercises" / "selfcheck.py"  # what every self-check block calls
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


EXERCISES = parse_exercises(BOOK.read_text())


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
    assert all(2 <= len(ids) <= 4 for ids in by_lesson.values()), by_lesson
    text = PLAN.read_text()
    hand_ins = re.findall(r"Hand in\s+exercises?\s+([0-9.,\sand]+)", text)
    handed_in = re.findall(r"\d+\.\d+", " ".join(hand_ins))
    assert sorted(handed_in) == sorted(EXERCISES), "the path hands in every exercise, once"
    launches = sum(s.count("torchrun ") for e in EXERCISES.values() for s in e["run"])
    assert launches <= 2, "keep the test to at most 2 torchrun launches"


def test_every_lesson_lists_exactly_its_own_exercises():
    """The book's exercises are the lessons' own: the Exercises section of lesson N links every
    exercise N.M of the book, by its heading's anchor, and no other."""
    headings = re.findall(r"^### (Exercise (\d+\.\d+): .+)$", BOOK.read_text(), re.M)
    exercise_of = {week.anchor_of(title): ex_id for title, ex_id in headings}
    for lesson in sorted((REPO / "lessons").glob("[0-9][0-9]_*.py")):
        text = lesson.read_text()
        start = text.index("# ## Exercises\n")
        end = text.find("\n# ## ", start + 1)
        section = text[start:end if end > 0 else len(text)]
        anchors = re.findall(r"\]\(\.\./docs/onboarding-exercises\.md#([\w-]+)\)", section)
        linked = sorted(exercise_of.get(anchor, f"#{anchor}") for anchor in anchors)
        own = sorted(e for e in EXERCISES if int(e.split(".")[0]) == int(lesson.name[:2]))
        assert linked == own, f"{lesson.name} links {linked}, the book has {own} for it"


def test_the_three_pages_link_each_other_and_every_anchor_exists():
    """The plan, its exercise book and the mentor's rubric were one page: each links the other
    two, and every #anchor into one of them (from any of them) names a heading there."""
    pages = {page.name: page.read_text() for page in (PLAN, BOOK, RUBRIC)}
    for name, text in pages.items():
        links = re.findall(r"\]\(([\w-]*\.md)?(?:#([\w-]+))?\)", text)
        assert {n for n in pages if n != name} <= {target for target, _ in links}, name
        for target, anchor in links:
            if anchor and (target or name) in pages:
                week.section(pages[target or name], anchor)  # raises when it is not there


def test_path_covers_every_lesson_lab_and_runbook():
    text = PLAN.read_text()
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
    text = PLAN.read_text()
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


@pytest.mark.parametrize("ex_id", sorted(EXERCISES))
def test_pasting_the_self_check_as_the_answer_fails(ex_id, out_dir):
    """The self-check block shows nothing to copy: given as the answer, it still fails."""
    check = EXERCISES[ex_id]["self-check"]
    pasted = run_python(check + "\n" + check, out_dir)
    assert pasted.returncode != 0, f"self-check {ex_id} passes when pasted as its own answer"


def reference_calls():
    """Names of the functions exercises/selfcheck.py calls in the course's (or torch's) code
    to compute its references (estimate_per_rank, datasheet_tokens_per_s, bus_factor, ...)
    and its own helpers; not the learner's functions it is given."""
    tree = ast.parse(SELFCHECK.read_text())
    imported = {alias.asname or alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    calls = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            calls.add(node.func.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            calls.add(node.func.id)
    answers = {arg.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
               for arg in node.args.args}  # the learner's functions, passed in to be checked
    return {c for c in calls if c in imported or c not in dir(builtins)} - answers


def test_self_checks_only_call_their_check():
    """A self-check block imports exercises/selfcheck.py and calls check_N_M with the
    exercise's names: it never calls what computes the reference itself."""
    references = reference_calls()
    assert {"estimate_per_rank", "datasheet_tokens_per_s", "bus_factor",
            "stage_ids_for_rank", "DistributedSampler"} <= references, references
    for ex_id, exercise in sorted(EXERCISES.items()):
        tree = ast.parse(exercise["self-check"])
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & references, f"self-check {ex_id} calls {names & references}"
        calls = [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)]
        want = f"selfcheck.check_{ex_id.replace('.', '_')}"
        assert sorted(calls) == sorted(["sys.path.insert", want]), (ex_id, calls)


WEEK_HEADER = "| day | steps | read | run (measured) | hand in |\n|---|---|---|---|---|\n"


def week_rows(text):
    """The figures of each row of "Your week": the steps it names, the words and reading
    minutes, the measured run seconds and how many commands it says are not timed."""
    table = text.split(WEEK_HEADER, 1)[1].split("\n\n")[0]
    rows = []
    for line in table.splitlines():
        _day, steps, read, run, _hand_in = (cell.strip() for cell in line.strip("|").split("|"))
        words, minutes = re.fullmatch(r"([\d,]+) words: (\d+) min", read).groups()
        run_min, run_s, untimed = re.match(r"(?:(\d+) min )?(\d+) s(?: \+ (\d+) not timed)?",
                                           run).groups()
        rows.append({"steps": [s if s in week.CAPSTONES else int(s)
                               for s in steps.split(":")[0].split(", ")],
                     "figures": (int(words.replace(",", "")), int(minutes),
                                 60 * int(run_min or 0) + int(run_s), int(untimed or 0))})
    return rows


def test_the_week_is_planned_from_measured_figures():
    """Each day's reading minutes are its pages' words at the stated rate, its run time the
    timing table's, and the days are the steps packed as tools/onboarding_week.py packs them."""
    text = PLAN.read_text()
    rows = week_rows(text)
    days = week.plan_days()
    assert [row["steps"] for row in rows] == days, "run python tools/onboarding_week.py"
    for row in rows:
        words, minutes, seconds, untimed = week.day_cost(row["steps"])
        assert row["figures"] == (words, minutes, seconds, len(untimed)), (
            f"steps {row['steps']}: the table says {row['figures']}, the pages give "
            f"{(words, minutes, seconds, len(untimed))}; run python tools/onboarding_week.py")
    assert f"**{len(days)} days**" in text and f"at {week.WORDS_PER_MINUTE} words a minute" in text


def test_words_are_counted_as_a_reader_reads_them():
    page = "# T\n\nOne two.\n\n## A b\n\n| x | y |\n|---|---|\n<!-- hidden -->\n### C\nthree\n## D\nfour\n"
    assert week.count_words(page) == 11  # T One two. A b x y C three D four: no `|`, `#`, `---`
    assert week.count_words(week.section(page, "a-b")) == 6  # A b x y C three: up to "## D"
    with pytest.raises(ValueError):
        week.section(page, "missing")
