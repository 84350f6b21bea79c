"""Every command the README shows, run by a test: `make course` end to end here, the rest here
or by the test named for it in README_COMMANDS.

`make course` runs as a user runs it, through make, with this interpreter. It comes after the
lessons in the suite (testpaths order), so it reuses the notebooks nbval has just executed
(nothing runs twice) and still runs every lab under torchrun and builds both editions of the
site. Any stage that crashes, and any line on the console that is not one of the runner's
own, fails it.
"""

import ast
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from launcher import LABS, PYTHON, REPO, quiet_env, run_lab

README = REPO / "README.md"

# Each command the README shows -> the test that runs it ("file::test", or a test in this
# file). A command added to the README without an entry here fails
# test_every_readme_command_is_run_by_a_test.
README_COMMANDS = {
    "make course": "test_make_course_runs_every_stage_quietly",
    "make test": "test_environment.py::test_ci_runs_exactly_the_readme_test_command",
    "make test LOCK=": "test_make_test_without_the_lock_keeps_your_torch",
    "make site": "test_site.py::test_no_broken_internal_links_or_anchors",
    "make gpu-check": "test_make_gpu_check_without_a_gpu_says_so",
    "python -m http.server -d site":
        "test_site.py::test_browser_renders_home_and_navigates_to_a_lesson",
    "pip config set global.index-url https://<your-mirror>/simple":
        "test_a_pip_mirror_reaches_the_pip_make_uses",
    "export PIP_INDEX_URL=https://<your-mirror>/simple":
        "test_a_pip_mirror_reaches_the_pip_make_uses",
    "export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu":
        "test_a_pip_mirror_reaches_the_pip_make_uses",
    "pip install --group learner -c requirements.lock":
        "test_the_learner_group_is_what_reading_along_needs",
    "python labs/lab01_ddp.py": "test_lab01_alone_and_under_torchrun_print_the_readme_lines",
    "torchrun --standalone --nproc-per-node 2 labs/lab01_ddp.py --check-parity":
        "test_lab01_alone_and_under_torchrun_print_the_readme_lines",
    "torchrun --standalone --nproc-per-node 8 labs/lab01_ddp.py": "test_lab01_on_8_gpus",
    'torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint '
    '"$HEAD_NODE_ADDR:29400" --rdzv-id "$SLURM_JOB_ID" labs/lab01_ddp.py':
        "test_multinode.py::test_two_agents_match_one_agent",
    "python labs/lab02_fsdp.py --plan --model 8b --nproc 8 --gpu H100-80GB":
        "test_the_readme_plan_command",
    ".venv/bin/jupyter lab lessons/":
        "test_jupyter_and_publishing.py::test_jupyter_opens_each_lesson_as_a_notebook",
    "python exercises/grade.py ddp":
        "test_exercises.py::test_untouched_stub_fails_naming_the_function",
    "python tools/i18n.py status": "test_the_i18n_commands",
    "python tools/i18n.py check i18n/zh/<path>": "test_the_i18n_commands",
    "python tools/i18n.py stamp i18n/zh/<path>": "test_the_i18n_commands",
}
COMMAND_START = re.compile(r"^(make|python3?|torchrun|pip|export|conda|\S*/?jupyter|\.venv/\S+) ")


def readme_commands():
    """The command lines of the README's bash blocks, and its inline code that is a command."""
    text = README.read_text()
    found = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                found.append(line)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if " " in span and COMMAND_START.match(span):
            found.append(span)
    return found


def test_every_readme_command_is_run_by_a_test():
    commands = readme_commands()
    missing = sorted(set(commands) - set(README_COMMANDS))
    assert not missing, f"README commands no test runs (add them to README_COMMANDS): {missing}"
    gone = sorted(set(README_COMMANDS) - set(commands))
    assert not gone, f"README_COMMANDS lists commands the README no longer shows: {gone}"
    for command, target in README_COMMANDS.items():
        path, _, name = target.rpartition("::")
        source = Path(__file__).parent / (path or Path(__file__).name)
        tests = {node.name for node in ast.parse(source.read_text()).body
                 if isinstance(node, ast.FunctionDef)}
        assert name in tests, f"{command!r}: {target} does not exist"


def test_the_command_scanner_finds_block_and_inline_commands(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text("Run `make course`, then\n`python labs/x.py\n--steps 3`; not `.venv/`.\n"
                      "```bash\nmake test   # all of it\ntorchrun --nproc-per-node 2 \\\n"
                      "    labs/x.py\n```\n```text\nstep 1 | loss\n```\n")
    monkeypatch.setattr(__import__(__name__), "README", readme)
    assert readme_commands() == ["make test", "torchrun --nproc-per-node 2 labs/x.py",
                                 "make course", "python labs/x.py --steps 3"]


# --- make course -------------------------------------------------------------------------

# Every line `make course` may print (make's own two lines and the runner's). Anything else,
# a warning from torch, a kernel's log line, a traceback, fails the test.
COURSE_LINES = [
    r">> installing the site group, as requirements\.lock pins it, into \S+",
    r"\S*python\S* tools/course\.py",
    r"\[lab \d/\d\] lab\d\d_\w+\.py: torchrun x\d+ --check-parity \.\.\. \d+ s \| done \| .*",
    r"\[lessons\] executing \d+: .*",
    r"\[lesson \d/\d\] \d\d_\w+\.py: (\d+ s|up to date \(its executed notebook is reused\))",
    r"\[site\] mkdocs build --strict, English and 简体中文 \(site/zh/\) at the same time \.\.\. "
    r"en \d+ s \| zh \d+ s",
    r"lab +\| backend +\| world .*",
    r"[-+]+",
    r"lab\d\d_\w+ +\| \w+ +\| \d+ .*",
    r"\d+ labs, \d+ lessons, site at site/index\.html \| labs \d+ s, lessons \d+ s, site \d+ s "
    r"\| \d+ s in total",
    r"",
]


# The lesson make course executes itself, whatever the suite left: the quickest one. The
# others are reused from nbval's run when it passed, so both paths of the stage run.
EXECUTED_BY_THE_COURSE = "08_expert_parallel"


@pytest.fixture(scope="module")
def make_course():
    """`make course` with this interpreter; the CompletedProcess, its wall time and its start."""
    (REPO / "build" / "executed" / "lessons" / f"{EXECUTED_BY_THE_COURSE}.ipynb").unlink(
        missing_ok=True)
    started = time.time()
    proc = subprocess.run(["make", "--no-print-directory", "course", f"PY={PYTHON}"], cwd=REPO,
                          capture_output=True, text=True, timeout=1800, env=quiet_env())
    seconds = time.time() - started
    print(f"make course: {seconds:.0f} s\n{proc.stdout}")
    return proc, seconds, started


def test_make_course_runs_every_stage_quietly(make_course):
    proc, seconds, started = make_course
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    noise = [line for line in lines if not any(re.fullmatch(p, line) for p in COURSE_LINES)]
    assert not noise, "lines that are not the runner's own:\n" + "\n".join(noise[:40])
    labs = sorted(LABS.glob("lab[0-9][0-9]_*.py"))
    lessons = sorted((REPO / "lessons").glob("[0-9][0-9]_*.py"))
    for lab in labs:
        assert sum(line.startswith("[lab ") and f" {lab.name}: " in line for line in lines) == 1
        # The one run per suite of each lab under real torchrun, with a real interpreter exit
        # (the forked ranks of the other lab tests skip it): every rank exited 0, and cleanly.
        log = (REPO / "build" / "course" / f"{lab.stem}.log").read_text()
        assert "done | " in log and "terminate called" not in log, log[-3000:]
    for lesson in lessons:
        assert sum(line.startswith("[lesson ") and f" {lesson.name}: " in line
                   for line in lines) == 1, lesson.name
    summary = f"{len(labs)} labs, {len(lessons)} lessons, site at site/index.html"
    assert lines[-1].startswith(summary), lines[-1]
    # The README's budget. Here the lessons nbval has executed are reused, so this bounds the
    # labs, the site and what the runner itself adds; the clean-clone figure (every lesson
    # executed too) is measured and stated in the README.
    assert seconds < 600, f"make course took {seconds:.0f} s"


def test_make_course_summary_table_shows_parity_for_every_lab(make_course):
    proc, _, _ = make_course
    summary = json.loads((REPO / "build" / "course" / "summary.json").read_text())
    assert [m["lab"] for m in summary] == [p.stem for p in sorted(LABS.glob("lab[0-9][0-9]_*.py"))]
    for metrics in summary:
        assert metrics["parity_max_abs_diff"] <= metrics["parity_tol"] <= 1e-5, metrics["lab"]
        row = next(line for line in proc.stdout.splitlines()
                   if line.startswith(metrics["lab"] + " "))
        assert f"{metrics['final_loss']:.4f}" in row, row
        assert f"{metrics['parity_max_abs_diff']:.1e}" in row, row


def test_make_course_executes_a_lesson_in_its_own_kernel(make_course):
    """The lesson it had to execute ran through the runner's own path (a process per lesson,
    a kernel over private IPC sockets, the kernel's output in a log), not nbval's."""
    proc, _, started = make_course
    line = next(line for line in proc.stdout.splitlines()
                if f"] {EXECUTED_BY_THE_COURSE}.py: " in line)
    assert re.search(r": \d+ s$", line), line
    assert (REPO / "build" / "course" / "lessons" / f"{EXECUTED_BY_THE_COURSE}.log").exists()
    executed = REPO / "build" / "executed" / "lessons" / f"{EXECUTED_BY_THE_COURSE}.ipynb"
    assert executed.stat().st_mtime >= started
    assert not list((REPO / "lessons").glob("kernel-ipc*")), "sockets left in lessons/"


def test_make_course_builds_both_editions_and_keeps_the_lessons_it_ran(make_course):
    _, _, started = make_course
    for page in ("site/index.html", "site/zh/index.html", "site/lessons/01_ddp.html",
                 "site/zh/lessons/01_ddp.html"):
        assert (REPO / page).stat().st_mtime >= started, f"{page} is not from this run"
    for lesson in sorted((REPO / "lessons").glob("[0-9][0-9]_*.py")):
        executed = REPO / "build" / "executed" / "lessons" / (lesson.stem + ".ipynb")
        assert executed.exists(), executed


# --- the other commands ------------------------------------------------------------------

def test_make_test_without_the_lock_keeps_your_torch():
    """`make test LOCK=` installs the test group's ranges (pyproject.toml) and no pins, so pip
    keeps an installed torch build that satisfies them (a CUDA one, say); plain `make test`
    holds every package to requirements.lock. Shown by make itself, without running the suite
    inside the suite: -n prints the recipe it would run."""
    locked, unlocked = (subprocess.run(["make", "-n", "test", *extra], cwd=REPO,
                                       capture_output=True, text=True, timeout=60).stdout
                        for extra in ([], ["LOCK="]))
    install = lambda recipe: [line for line in recipe.splitlines()  # noqa: E731
                              if "-m pip" in line and "--group" in line]
    assert [line.split("install", 1)[1].strip() for line in install(locked)] == [
        "--quiet --group test -c requirements.lock"]
    assert [line.split("install", 1)[1].strip() for line in install(unlocked)] == [
        "--quiet --group test"]
    course = subprocess.run(["make", "-n", "course"], cwd=REPO, capture_output=True, text=True,
                            timeout=60).stdout
    assert [line.split("install", 1)[1].strip() for line in install(course)] == [
        "--quiet --group site -c requirements.lock"]


def test_make_gpu_check_without_a_gpu_says_so():
    import gpu_check  # tools/gpu_check.py

    proc = subprocess.run(["make", "--no-print-directory", "gpu-check", f"PY={PYTHON}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=quiet_env({"CUDA_VISIBLE_DEVICES": ""}))
    assert proc.returncode != 0 and gpu_check.NO_GPU in proc.stderr.splitlines(), proc.stderr


def test_a_pip_mirror_reaches_the_pip_make_uses(tmp_path):
    """The README's two ways to point pip at a mirror, seen by `$(PY) -m pip`, the pip that
    `make` runs (the Makefile passes no index option of its own). `pip config set` writes the
    user's pip.conf: here a scratch home's, never the real one."""
    home = tmp_path / "home"
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    env.pop("PIP_CONFIG_FILE", None)
    set_it = subprocess.run([PYTHON, "-m", "pip", "config", "set", "global.index-url",
                             "https://mirror.example/simple"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert set_it.returncode == 0, set_it.stderr
    assert "mirror.example" in (home / ".config" / "pip" / "pip.conf").read_text()
    listed = subprocess.run([PYTHON, "-m", "pip", "config", "list"], env=env,
                            capture_output=True, text=True, timeout=60).stdout
    assert "global.index-url='https://mirror.example/simple'" in listed
    exported = subprocess.run(
        ["bash", "-c", "export PIP_INDEX_URL=https://mirror.example/simple && "
                       f"{PYTHON} -m pip config list"],
        capture_output=True, text=True, timeout=60, env={**env, "HOME": str(tmp_path)}).stdout
    assert ":env:.index-url='https://mirror.example/simple'" in exported
    extra = subprocess.run(
        ["bash", "-c", "export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu && "
                       f"{PYTHON} -m pip config list"],
        capture_output=True, text=True, timeout=60, env={**env, "HOME": str(tmp_path)}).stdout
    assert ":env:.extra-index-url='https://download.pytorch.org/whl/cpu'" in extra
    makefile = (REPO / "Makefile").read_text()
    assert "PIP := $(PY) -m pip " in makefile and "index-url" not in makefile


def test_the_learner_group_is_what_reading_along_needs(tmp_path):
    """The README's learner install, resolved as into an empty environment (pip's --dry-run
    --ignore-installed --report): torch as the lock pins it and the notebook stack, and none of
    the site's or the tests' tools."""
    report = tmp_path / "report.json"
    proc = subprocess.run([PYTHON, "-m", "pip", "install", "--group", "learner", "-c",
                           "requirements.lock", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    would = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
             for item in json.loads(report.read_text())["install"]}
    assert would["torch"] == "2.13.0+cpu"
    assert {"jupyterlab", "jupytext", "matplotlib", "ipykernel", "nbclient"} <= set(would)
    assert not {"mkdocs", "mkdocs-material", "pytest", "nbval", "playwright"} & set(would)


STEP_LINE = re.compile(r"step +\d+ \| loss \d\.\d{4} \| [\d.]+ ms \| \d+ tok/s \| data \d+% \| "
                       r"mem [\d.]+ GiB")
DONE_LINE = re.compile(r"done \| lab01_ddp \| gloo x(\d) \| 40 steps \| loss \d\.\d{4} \| "
                       r"parity (\S+) \| \d+ tok/s \| MFU [\d.]+% \| [\d.]+ s")


def test_lab01_alone_and_under_torchrun_print_the_readme_lines():
    """The README's first two lab commands, as written (torchrun itself for the second), end
    with the two lines the README shows under them, in the same format."""
    shown = re.search(r"```text\n(step .*)\n(done .*)\n```", README.read_text())
    assert STEP_LINE.fullmatch(shown[1]) and DONE_LINE.fullmatch(shown[2]), shown.groups()
    alone = subprocess.run([PYTHON, "labs/lab01_ddp.py"], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env=quiet_env())
    path = f"{Path(PYTHON).parent}{os.pathsep}{os.environ['PATH']}"  # this env's torchrun
    launched = subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "2",
                               "labs/lab01_ddp.py", "--check-parity"], cwd=REPO,
                              capture_output=True, text=True, timeout=300,
                              env=quiet_env({"PATH": path}))
    for proc, world_size in ((alone, "1"), (launched, "2")):
        assert proc.returncode == 0, proc.stderr[-3000:]
        *_, step, done = proc.stdout.splitlines()
        assert STEP_LINE.fullmatch(step), step
        assert DONE_LINE.fullmatch(done) and DONE_LINE.fullmatch(done)[1] == world_size, done
    assert float(DONE_LINE.fullmatch(launched.stdout.splitlines()[-1])[2]) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 8, reason="the README's 8-GPU command needs 8 GPUs")
def test_lab01_on_8_gpus():
    proc = subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "8",
                           "labs/lab01_ddp.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("done | lab01_ddp | nccl x8 | 40 steps")


def test_the_readme_plan_command():
    proc = subprocess.run([PYTHON, "labs/lab02_fsdp.py", "--plan", "--model", "8b", "--nproc",
                           "8", "--gpu", "H100-80GB"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=quiet_env())
    assert proc.returncode == 0, proc.stderr
    assert "plan | lab02_fsdp | 8 x H100-80GB | --model 8b: 8.03B params" in proc.stdout


def test_the_i18n_commands(tmp_path):
    """status, check and stamp as the README runs them; stamp on a copy of the record, so the
    suite leaves the repository as it found it."""
    status = subprocess.run([PYTHON, "tools/i18n.py", "status"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert status.returncode == 0 and "stale: 0" in status.stdout, status.stdout + status.stderr
    page = "i18n/zh/docs/index.md"
    check = subprocess.run([PYTHON, "tools/i18n.py", "check", page], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "0 problems" in check.stdout, check.stdout + check.stderr
    sources = REPO / "i18n" / "zh" / "sources.json"
    before = sources.read_bytes()
    try:
        stamp = subprocess.run([PYTHON, "tools/i18n.py", "stamp", page], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
        assert stamp.returncode == 0, stamp.stderr
        assert sources.read_bytes() == before  # the page was current: its stamp is unchanged
    finally:
        sources.write_bytes(before)


def test_the_licence_is_apache_2_and_the_readme_says_what_it_covers():
    """People copy the labs into their projects: the terms must be in the repository."""
    licence = (REPO / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in licence
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in licence
    assert "END OF TERMS AND CONDITIONS" in licence
    readme = (REPO / "README.md").read_text()
    section = " ".join(readme.split("## Licence\n", 1)[1].split("\n## ", 1)[0].split())
    assert "Apache License 2.0 ([LICENSE](LICENSE))" in section
    for covered in ("labs", "labs/labkit/", "lessons", "runbooks", "both languages"):
        assert covered in section, covered


STREAM_FIELDS = {"step", "loss", "step_s", "tokens_per_s", "data_share", "mem_bytes", "time"}


def readme_python_blocks():
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


@pytest.fixture(scope="module")
def metrics_stream(tmp_path_factory):
    """lab01 at 2 ranks, logging every 5 of 20 steps into --metrics-stream: stopped after
    step 10 as if interrupted, then resumed to the end (the stream continues)."""
    folder = tmp_path_factory.mktemp("stream")
    common = ["--steps", 20, "--log-every", 5, "--metrics-stream", folder / "run.jsonl",
              "--checkpoint-dir", folder / "ckpt"]
    run_lab("lab01_ddp", 2, [*common, "--stop-at-step", 10], folder)
    _, metrics = run_lab("lab01_ddp", 2, common, folder)
    return folder, metrics


def test_the_metrics_stream_has_a_line_per_logged_step(metrics_stream):
    folder, metrics = metrics_stream
    rows = [json.loads(line) for line in (folder / "run.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [5, 10, 15, 20]  # the resumed run appended
    assert all(set(row) == STREAM_FIELDS for row in rows), rows[0]
    losses = dict(map(tuple, metrics["losses"]))  # the resumed run's, steps 11..20
    assert [row["loss"] for row in rows[2:]] == [losses[15], losses[20]]
    assert all(row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["mem_bytes"] > 2**20
               for row in rows)
    assert [row["time"] for row in rows] == sorted(row["time"] for row in rows)


def test_the_readme_loads_the_metrics_stream_in_a_notebook(metrics_stream, monkeypatch, capsys):
    folder, _ = metrics_stream
    notebook = next(block for block in readme_python_blocks() if "steps = [" in block)
    monkeypatch.chdir(folder)
    exec(compile(notebook, "README.md", "exec"), {})
    step, loss, tokens_per_s = capsys.readouterr().out.split()
    assert int(step) == 20 and float(loss) > 0 and float(tokens_per_s) > 0


def test_the_readme_loads_the_metrics_stream_into_tensorboard(metrics_stream, monkeypatch):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed here "
                        "(the course does not need it); the README's TensorBoard lines run "
                        "wherever it is")
    folder, _ = metrics_stream
    block = next(block for block in readme_python_blocks() if "SummaryWriter" in block)
    monkeypatch.chdir(folder)
    exec(compile(block, "README.md", "exec"), {})
    assert list((folder / "runs" / "lab01").glob("events.out.tfevents.*"))
