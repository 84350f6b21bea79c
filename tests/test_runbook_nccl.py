"""The NCCL runbooks (nccl-watchdog-timeout, nccl-errors, nccl-p2p-hang): what a CPU machine checks.

The torch wheel here is a CPU build: no NCCL, no ProcessGroupNCCL, so none of the pages' NCCL
messages can be produced. Instead every page carries a "GPU-only messages" table that gives, for
each quoted message, a stable substring, the function that emits it, and its source file:line at
a named version (PyTorch v2.6.0, NCCL tags, nccl-tests) or the public report it is quoted from.
This file checks what can be checked here:

- each page follows the runbook skeleton and says "GPU only, not executed in CI";
- each table row: its substring is on the page outside the table, its source cell is a
  file:line @ version (or a report), and its last column ("in the installed CPU torch") is true
  for the installed torch (its .py files and the bytes of torch/lib/*.so);
- rows and facts whose source is the installed torch 2.13 (its headers and .py files): the cited
  line holds the text;
- with SOURCE_ROOT set to a folder holding pytorch-v2.6.0/, nccl-v2.30.7-1/ (and the other tags
  cited) and nccl-tests-v2.19.6/, every other row and every NCCL variable; skipped, with the
  reason, when it is not set;
- every TORCH_* variable a page names is spelled as the installed torch spells it, and every
  NCCL_* variable is one listed below with its NCCL source line;
- links lead to files and headings that exist;
- executed: torchrun's summary for a worker killed by SIGABRT (what a watchdog abort looks like
  from the launcher) and the page's stall script, on gloo.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import error_index  # tools/error_index.py (conftest puts tools/ on the path)
from launcher import PYTHON, REPO, quiet_env
from test_docs_commands import parse_command, script_flags, torchrun_flags
from test_reference_pages import anchors_of

RUNBOOKS = REPO / "runbooks"
PAGES = [RUNBOOKS / name for name in
         ("nccl-watchdog-timeout.md", "nccl-errors.md", "nccl-p2p-hang.md")]
TORCH_DIR = Path(torch.__file__).resolve().parent
SOURCE_ROOT = os.environ.get("SOURCE_ROOT", "")
SKELETON = ["Symptoms", "Quick triage", "Diagnose", "Causes and fixes", "Reproduce it",
            "Prevent", "Related"]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LAUNCH_TIMEOUT = 150

# The versions a source cell may name, and where SOURCE_ROOT keeps each tree.
VERSIONS = {
    ("pytorch", "v2.6.0"): "pytorch-v2.6.0",
    ("nccl", "v2.23.4-1"): "nccl-v2.23.4-1",
    ("nccl", "v2.27.7-1"): "nccl-v2.27.7-1",
    ("nccl", "v2.29.7-1"): "nccl-v2.29.7-1",
    ("nccl", "v2.30.7-1"): "nccl-v2.30.7-1",
    ("nccl-tests", "v2.19.6"): "nccl-tests-v2.19.6",
    ("torch", "2.13.0"): None,  # the installed wheel, checked without SOURCE_ROOT
}
SOURCE_REF = re.compile(r"`(?P<path>[\w./-]+):(?P<start>\d+)(?:-(?P<end>\d+))?` @ "
                        r"(?P<project>pytorch|nccl-tests|nccl|torch) (?P<version>[\w.+-]+)")
REPORT_REF = re.compile(r"report: [\w.-]+/[\w.-]+#\d+")

# Every NCCL_* variable the pages may name: where NCCL v2.30.7-1 reads it, and the text there.
# NCCL_PARAM(Name, "SUFFIX", default) reads NCCL_<SUFFIX>; the others call ncclGetEnv.
NCCL_VARS = {
    "NCCL_DEBUG": ("src/debug.cc", 45, "NCCL_DEBUG, NCCL_LOG_NONE"),
    "NCCL_DEBUG_SUBSYS": ("src/debug.cc", 55, "NCCL_DEBUG_SUBSYS"),
    "NCCL_DEBUG_TIMESTAMP_LEVELS": ("src/debug.cc", 85, "NCCL_DEBUG_TIMESTAMP_LEVELS"),
    "NCCL_DEBUG_FILE": ("src/debug.cc", 103, "NCCL_DEBUG_FILE"),
    "NCCL_SOCKET_FAMILY": ("src/misc/socket.cc", 180, '"NCCL_SOCKET_FAMILY"'),
    "NCCL_SOCKET_IFNAME": ("src/misc/socket.cc", 196, '"NCCL_SOCKET_IFNAME"'),
    "NCCL_IB_HCA": ("src/transport/net_ib/init.cc", 317, '"NCCL_IB_HCA"'),
    "NCCL_IB_DISABLE": ("src/transport/net_ib/init.cc", 27, '"IB_DISABLE", 0'),
    "NCCL_IB_TIMEOUT": ("src/transport/net_ib/connect.cc", 15, '"IB_TIMEOUT", 20'),
    "NCCL_IB_RETRY_CNT": ("src/transport/net_ib/connect.cc", 16, '"IB_RETRY_CNT", 7'),
    "NCCL_P2P_DISABLE": ("src/graph/paths.cc", 289, '"NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL"'),
    "NCCL_P2P_LEVEL": ("src/graph/paths.cc", 289, '"NCCL_P2P_LEVEL"'),
    "NCCL_SHM_DISABLE": ("src/transport/shm.cc", 55, '"SHM_DISABLE", 0'),
    "NCCL_RUNTIME_CONNECT": ("src/init.cc", 61, '"RUNTIME_CONNECT", 1'),
    "NCCL_MULTI_RANK_GPU_ENABLE": ("src/init.cc", 68, '"MULTI_RANK_GPU_ENABLE", 0'),
}
# Not NCCL variables but nccl-tests' build variables (`make MPI=1 ... NCCL_HOME=...`, README.md:18).
NCCL_TESTS_MAKE_VARS = {"NCCL_HOME"}
# nccl-tests binaries the pages may name: BIN_FILES_LIST in src/Makefile:37 @ v2.19.6.
NCCL_TESTS_BINARIES = {f"{name}_perf" for name in (
    "all_reduce all_gather broadcast reduce_scatter reduce alltoall alltoallv scatter gather "
    "sendrecv hypercube").split()}

# Facts the pages state about the installed torch 2.13: (page, citation as written on the page,
# file under the torch package, first line, last line, text that must be in those lines).
INSTALLED_FACTS = [
    ("nccl-watchdog-timeout.md", "ProcessGroupNCCL.hpp:157",
     "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp", 157, 158,
     "std::chrono::milliseconds(10 * 60 * 1000)"),
    ("nccl-watchdog-timeout.md", "ProcessGroupNCCL.hpp:71-73",
     "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp", 71, 73,
     "TORCH_NCCL_ENABLE_MONITORING=1 and TORCH_NCCL_TRACE_BUFFER_SIZE > 0"),
    ("distributed-env-reference.md", "ProcessGroupNCCL.hpp:71-73",
     "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp", 71, 73,
     "TORCH_NCCL_ENABLE_MONITORING=1 and TORCH_NCCL_TRACE_BUFFER_SIZE > 0"),
    ("nccl-watchdog-timeout.md", "FlightRecorder.hpp:99-125",
     "include/torch/csrc/distributed/c10d/FlightRecorder.hpp", 99, 104,
     "static FlightRecorder<EventType>* instance"),
    ("nccl-watchdog-timeout.md", "FlightRecorder.hpp:99-125",
     "include/torch/csrc/distributed/c10d/FlightRecorder.hpp", 123, 125, "size_t pg_id_;"),
    ("nccl-watchdog-timeout.md", "FlightRecorder.hpp:110-111",
     "include/torch/csrc/distributed/c10d/FlightRecorder.hpp", 110, 111,
     '{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000'),
    ("nccl-watchdog-timeout.md", "FlightRecorderDetail.hpp:28-29",
     "include/torch/csrc/distributed/c10d/FlightRecorderDetail.hpp", 28, 29,
     "oss << '#' << idx << ' ' << frame.funcname << \" from \" << frame.filename"),
    ("nccl-watchdog-timeout.md", "distributed_c10d.py:2283-2305",
     "distributed/distributed_c10d.py", 2283, 2305, "_create_process_group_wrapper("),
    ("nccl-watchdog-timeout.md", "distributed_c10d.py:2283-2305",
     "distributed/distributed_c10d.py", 2283, 2285, "Backend.NCCL"),
    ("nccl-errors.md", "NCCLUtils.hpp:22-24",
     "include/torch/csrc/distributed/c10d/NCCLUtils.hpp", 22, 24,
     "NCCL version must be 2.23 or later"),
    ("nccl-errors.md", "NCCLUtils.hpp:63-72",
     "include/torch/csrc/distributed/c10d/NCCLUtils.hpp", 63, 72,
     '"NCCL error in: " + std::string(__FILE__) + ":" +'),
    ("nccl-errors.md", "NCCLUtils.hpp:63-72",
     "include/torch/csrc/distributed/c10d/NCCLUtils.hpp", 63, 72,
     '"\\n" + getNcclErrorDetailStr(result, failureReason)'),
]


# ------------------------------------------------------------------ reading the pages
def page_text(page):
    return page.read_text()


def h2_headings(text):
    return re.findall(r"^## (.+?)\s*$", FENCE.sub("", text), re.M)


def section(text, heading, level=2):
    """The body under `heading` up to the next heading of the same or a higher level."""
    found = re.search(rf"^{'#' * level} {re.escape(heading)}\s*$(.*?)(?=^#{{1,{level}}} |\Z)",
                      text, re.S | re.M)
    return found.group(1) if found else None


def table_rows(page):
    """The rows of the page's "GPU-only messages" table: (substring, emitted by, source, in cpu)."""
    body = section(page_text(page), "GPU-only messages", level=3)
    assert body is not None, f"{page.name}: no '### GPU-only messages' table"
    rows = []
    for line in body.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if cells[0].startswith("message"):
            continue  # the header row
        assert len(cells) == 4, f"{page.name}: row has {len(cells)} cells: {line}"
        quoted = re.fullmatch(r"`([^`]+)`", cells[0])
        assert quoted, f"{page.name}: first cell is not one `code` span: {cells[0]}"
        rows.append((quoted.group(1), cells[1], cells[2], cells[3]))
    return rows


def all_rows():
    return [(page, *row) for page in PAGES for row in table_rows(page)]


def rows_citing(installed):
    return [row for row in all_rows()
            if any((ref["project"] == "torch") == installed for ref in SOURCE_REF.finditer(row[3]))]


def row_name(row):
    return f"{row[0].stem}:{row[1].strip()[:40]}"


def window(path, start, end, margin=0):
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[max(0, start - 1 - margin):end + margin])


# ------------------------------------------------------------------ what the installed torch has
def scan(paths, needles, word=False):
    """The needles found in any of the files, read one file at a time (libtorch_cpu.so alone is
    hundreds of MB). word=True: only as a whole word (for variable names)."""
    found, left = set(), set(needles)
    for path in paths:
        data = path.read_bytes()
        for needle in list(left):
            if contains(data, needle.encode(), word):
                found.add(needle)
                left.discard(needle)
        if not left:
            break
    return found


def contains(data, needle, word):
    at = data.find(needle)
    while word and at != -1:
        before = data[at - 1:at] if at else b""
        after = data[at + len(needle):at + len(needle) + 1]
        if not re.match(rb"\w", before) and not re.match(rb"\w", after):
            return True
        at = data.find(needle, at + 1)
    return at != -1


def cpu_torch_files():
    """The installed torch as the tables' last column means it: .py files and torch/lib/*.so."""
    return [*TORCH_DIR.rglob("*.py"), *sorted((TORCH_DIR / "lib").glob("*.so*"))]


@pytest.fixture(scope="module")
def in_cpu_torch():
    """The rows' substrings found in the installed torch's .py files and torch/lib/*.so: the
    error index's corpus of the same files (read once per session, tools/error_index.py)."""
    corpus = error_index.torch_corpus()
    blobs = [corpus["python sources"], corpus["shared libraries"]]
    return {row[1] for row in all_rows() if any(row[1].encode() in blob for blob in blobs)}


@pytest.fixture(scope="module")
def torch_var_names():
    headers = [p for pattern in ("include/**/*.h", "include/**/*.hpp") for p in TORCH_DIR.glob(pattern)]
    names = {*names_on(r"\bTORCH_[A-Z0-9_]+"), "TORCH_NCCL_HEARTBEAT_TIMEOUT"}
    return scan([*headers, *cpu_torch_files()], names, word=True)


# ------------------------------------------------------------------ page shape
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_follows_the_runbook_skeleton(page):
    text = page_text(page)
    lines = text.splitlines()
    assert lines[0].startswith("# "), "the first line is the '# <what you see>' title"
    assert lines[2].startswith("> TL;DR: "), "the TL;DR follows the title"
    tldr = " ".join(line.lstrip("> ") for line in lines[2:12] if line.startswith(">"))
    for part in ("most likely cause", "fastest check", "fastest fix"):
        assert part in tldr, f"TL;DR lacks {part!r}"
    headings = h2_headings(text)
    positions = [headings.index(h) for h in SKELETON if h in headings]
    assert [h for h in SKELETON if h in headings] == SKELETON, f"missing: {headings}"
    assert positions == sorted(positions), f"skeleton out of order: {headings}"
    assert "GPU only, not executed in CI" in text
    symptoms = section(text, "Symptoms")
    assert "### GPU-only messages" in symptoms, "the messages table belongs to Symptoms"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_table_row_is_quoted_on_the_page_and_cites_a_source(page):
    text = page_text(page)
    outside_table = text.replace(section(text, "GPU-only messages", level=3), "")
    rows = table_rows(page)
    assert len(rows) >= 5, f"{page.name}: {len(rows)} rows"
    for substring, _, source, in_cpu in rows:
        squashed = re.sub(r"\s+", " ", outside_table)
        assert substring.strip() in squashed, f"{substring!r} is in the table only"
        refs = list(SOURCE_REF.finditer(source))
        assert refs or REPORT_REF.search(source), f"{substring!r}: no file:line @ version"
        for ref in refs:
            key = (ref["project"], ref["version"])
            assert key in VERSIONS, f"{substring!r}: unknown version {key}"
        assert in_cpu in ("yes", "no"), f"{substring!r}: last column is {in_cpu!r}"


def test_the_check_catches_a_row_without_a_source():
    """The row parser and the source pattern are strict enough to fail."""
    assert not SOURCE_REF.search("ProcessGroupNCCL.cpp:623 @ pytorch v2.6.0")  # no backticks
    assert not SOURCE_REF.search("`ProcessGroupNCCL.cpp` @ pytorch v2.6.0")  # no line
    assert SOURCE_REF.search("`src/init.cc:3422` @ nccl v2.30.7-1")["version"] == "v2.30.7-1"
    assert not REPORT_REF.search("report: somewhere")


@pytest.mark.parametrize("row", all_rows(), ids=row_name)
def test_in_the_cpu_torch_column_is_true(row, in_cpu_torch):
    page, substring, _, _, in_cpu = row
    found = substring in in_cpu_torch
    assert found == (in_cpu == "yes"), (
        f"{page.name}: {substring!r} is {'' if found else 'not '}in the installed torch "
        f"{torch.__version__} (.py files and torch/lib/*.so), the table says {in_cpu!r}")


@pytest.mark.parametrize("row", rows_citing(installed=True), ids=row_name)
def test_sources_in_the_installed_torch_hold_the_message(row):
    page, substring, _, source, _ = row
    refs = [r for r in SOURCE_REF.finditer(source) if r["project"] == "torch"]
    assert torch.__version__.startswith("2.13.0"), f"the pages cite 2.13.0, not {torch.__version__}"
    for ref in refs:
        path = TORCH_DIR.parent / ref["path"]
        start, end = int(ref["start"]), int(ref["end"] or ref["start"])
        assert substring.strip() in window(path, start, end), (
            f"{page.name}: {substring!r} is not at {ref['path']}:{start}")


@pytest.mark.parametrize("fact", INSTALLED_FACTS, ids=lambda f: f"{f[0]}:{f[1]}")
def test_facts_about_the_installed_torch(fact):
    page, citation, relative, start, end, needle = fact
    assert citation in page_text(RUNBOOKS / page), f"{page} no longer cites {citation}"
    assert needle in window(TORCH_DIR / relative, start, end), (
        f"{relative}:{start}-{end} does not hold {needle!r}")


def test_apis_the_pages_name_exist_in_the_installed_torch():
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    assert hasattr(c10d, "_dump_fr_trace") and hasattr(c10d, "_dump_fr_trace_json")
    assert issubclass(dist.DistBackendError, RuntimeError)
    doc = re.sub(r"\s+", " ", dist.init_process_group.__doc__)
    assert "the communicator is immediately formed" in doc
    assert "If you want to know NCCL initialization error early" in doc
    assert "Default value is 10 minutes for NCCL and 30 minutes for other backends" in doc


# ------------------------------------------------------------------ sources outside this machine
def source_tree(project, version):
    folder = VERSIONS[(project, version)]
    if folder is None:
        return None
    return Path(SOURCE_ROOT) / folder


def test_sources_outside_this_machine_hold_the_message():
    """One test over every row (one skip, not one per row, where the sources are absent)."""
    if not SOURCE_ROOT:
        pytest.skip("SOURCE_ROOT is not set (a folder with pytorch-v2.6.0/, nccl-v2.30.7-1/, ...)")
    rows = rows_citing(installed=False)
    assert rows
    for page, substring, _, source, _ in rows:
        refs = [r for r in SOURCE_REF.finditer(source) if r["project"] != "torch"]
        for ref in refs:
            path = source_tree(ref["project"], ref["version"]) / ref["path"]
            assert path.exists(), f"{path} is missing under SOURCE_ROOT"
            start, end = int(ref["start"]), int(ref["end"] or ref["start"])
            assert substring.strip() in window(path, start, end), (
                f"{page.name}: {substring!r} is not at {ref['path']}:{start} @ {ref['version']}")


def test_nccl_variables_are_read_where_the_table_says():
    if not SOURCE_ROOT:
        pytest.skip("SOURCE_ROOT is not set")
    tree = source_tree("nccl", "v2.30.7-1")
    for name, (relative, line, needle) in NCCL_VARS.items():
        assert needle in window(tree / relative, line, line), f"{name}: not at {relative}:{line}"
    makefile = window(source_tree("nccl-tests", "v2.19.6") / "src/Makefile", 37, 37)
    assert set(makefile.split(":=")[1].split()) == {b[:-5] for b in NCCL_TESTS_BINARIES}
    readme = window(source_tree("nccl-tests", "v2.19.6") / "README.md", 18, 18)
    assert all(f"{name}=" in readme for name in NCCL_TESTS_MAKE_VARS)


# ------------------------------------------------------------------ names the pages use
def names_on(pattern):
    return sorted({name for page in PAGES for name in re.findall(pattern, page_text(page))
                   if not name.endswith("_")})  # TORCH_NCCL_* is a wildcard, not a name


@pytest.mark.parametrize("name", names_on(r"\bTORCH_[A-Z0-9_]+"), ids=str)
def test_torch_variables_are_spelled_as_torch_spells_them(name, torch_var_names):
    assert name in torch_var_names, (
        f"{name} is in neither the .py files, the headers nor the libraries of torch "
        f"{torch.__version__}")


@pytest.mark.parametrize("name", names_on(r"\bNCCL_[A-Z0-9_]+"), ids=str)
def test_nccl_variables_are_ones_nccl_reads(name):
    assert name in NCCL_VARS or name in NCCL_TESTS_MAKE_VARS, (
        f"{name} is not a variable NCCL v2.30.7 reads (or add its source above)")


def test_nccl_tests_binaries_exist():
    named = names_on(r"\b[a-z_]+_perf\b")
    assert named, "the pages name no nccl-tests binary"
    assert set(named) <= NCCL_TESTS_BINARIES, set(named) - NCCL_TESTS_BINARIES


def test_the_name_checks_can_fail(torch_var_names):
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT" not in torch_var_names  # torch only knows ..._SEC
    assert "NCCL_TIMEOUT" not in NCCL_VARS and "NCCL_SOCKET_TIMEOUT" not in NCCL_VARS


# ------------------------------------------------------------------ commands
ANY_FENCE = re.compile(r"^( *)```[^\n]*\n(.*?)^\1```", re.S | re.M)  # list items indent theirs


def commands_on(page):
    """torchrun / python command lines in every code block, indented ones included (the
    course-wide docs-commands test reads only blocks at the left margin), and torchrun commands
    in inline code."""
    for _, block in ANY_FENCE.findall(page_text(page)):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if re.match(r"^(\S+=\S+\s+)*(torchrun|python3?)\s", line):
                yield line
    prose = ANY_FENCE.sub("", page_text(page))
    yield from re.findall(r"`((?:\S+=\S+\s+)*torchrun [^`]+)`", re.sub(r"\s*\n\s*", " ", prose))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_and_flags_exist(page):
    lines = list(commands_on(page))
    assert lines, f"{page.name}: no command found"
    for line in lines:
        launcher_flags, script, args = parse_command(line)
        unknown = {f.split("=")[0] for f in launcher_flags if f.startswith("--")} - torchrun_flags()
        assert not unknown, f"{line}: torchrun has no {unknown}"
        if script and "/" in script:
            assert (REPO / script).exists(), f"{line}: no {script}"
            missing = {a.split("=")[0] for a in args if a.startswith("--")} - script_flags(script)
            assert not missing, f"{line}: {script} has no {missing}"


# ------------------------------------------------------------------ links
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_lead_to_existing_pages_and_headings(page):
    text = FENCE.sub("", page_text(page))
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        source = (page.parent / path).resolve() if path else page
        if not source.exists():
            problems.append(f"{target}: no such file")
        elif anchor and anchor not in anchors_of(source):
            problems.append(f"{target}: no heading #{anchor}")
    assert problems == []


# ------------------------------------------------------------------ executed here
def run(cmd, timeout=LAUNCH_TIMEOUT):
    result = subprocess.run(list(map(str, cmd)), capture_output=True, text=True,
                            timeout=timeout, env=quiet_env(), cwd=REPO)
    return result.returncode, result.stdout + result.stderr


def test_torchrun_summary_of_a_worker_killed_by_sigabrt():
    """A watchdog abort is SIGABRT; torchrun reports it like any other worker that aborts."""
    rc, out = run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                   "--no-python", PYTHON, "-c", "import os; os.abort()"])
    assert rc != 0, out
    block = section(page_text(PAGES[0]), "Symptoms")
    quoted = re.search(r"```\n(  exitcode  : -6.*?)```", block, re.S)
    assert quoted, "the page no longer shows torchrun's SIGABRT summary"
    for line in quoted.group(1).splitlines():
        pattern = re.escape(line.strip()).replace(r"5095", r"\d+")
        assert re.search(pattern, out), f"{line.strip()!r} not in:\n{out}"
    assert -signal.SIGABRT == -6


def test_the_stall_script_on_the_page_runs_on_gloo(tmp_path):
    """Reproduce it: the page's script, unchanged, on CPU: rank 1 stalls 15 s, the timeout is
    3 s, so rank 0 fails in its second all_reduce with gloo's timeout."""
    text = page_text(PAGES[0])
    script = re.search(r"cat > stall_one_rank.py <<'EOF'\n(.*?)\nEOF\n", text, re.S)
    assert script, "the page no longer has the stall script"
    path = tmp_path / "stall_one_rank.py"
    path.write_text(script.group(1) + "\n")
    rc, out = run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   path, "3", "15"])
    assert rc != 0, out
    for expected in ("rank 0: step 1 ok", "rank 1: step 1 ok", "rank 0: failed:",
                     "Timed out waiting 3000ms"):
        assert expected in out, f"{expected!r} not in:\n{out}"
    assert "rank 0: step 2 ok" not in out, out
    assert "Timed out waiting" in re.sub(r"\s+", " ", page_text(PAGES[0]))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
