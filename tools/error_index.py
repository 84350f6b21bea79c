"""The error index (runbooks/errors.md) and the checks behind it.

Every message the course quotes must be real. A quoted message is checked in two steps:
1. it contains an entry of the index: a stable substring (no pid, rank, time, port, path or
   line number), so a pasted log line and a grep both find it;
2. each index entry occurs in the installed torch (its .py sources, or the bytes of its shared
   libraries), or sits in the index's source table with a file:line at a named version, for
   messages only a CUDA build, NCCL or an older release prints.

Used by tests/test_error_index.py; `python tools/error_index.py` prints what it finds.
"""

import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "runbooks" / "errors.md"
SOURCE_TABLE_HEADING = "## Quoted from source: GPU-only and older releases"

# What makes a line or code span an error message rather than prose or a command.
ERROR_WORDS = re.compile(r"Error\b|Error:|error:|\bfailed\b|Timed out|timed out|Exception|"
                         r"terminate called|killed by signal|exited unexpectedly|\bWARN\b|"
                         r"Expected to have|out of memory|Too many open files|No space left")
# Lines of an unlabelled block that are commands, code or traceback frames, not messages.
COMMAND_START = ("#", "python", "torchrun", "$", "export", "srun", "TORCH_", "NCCL_",
                 "PYTORCH_", "ulimit", "sudo", "dmesg", "journalctl", "ss ", "grep", "mpirun",
                 "docker", "kubectl", "py-spy", "pgrep", "except", "print(", "raise", 'File "',
                 "Traceback", "for ", "with ", "if ", "def ")
CODE_FENCES = {"python", "py", "bash", "sh", "shell", "yaml", "toml", "ini", "json"}
# A format sketch written for the reader (`<host>:<pid> NCCL WARN <text>`), not a message.
PLACEHOLDER = re.compile(r"<[a-z][\w .-]*>")
COURSE_SOURCES = ["runbooks/drills/*.py", "runbooks/drills/*.sh", "labs/*.py"]

# A stable substring has none of these: they change from run to run or build to build.
UNSTABLE = [(re.compile(r"\d{4,}"), "a number of 4+ digits (pid, port, time, size)"),
            (re.compile(r"\w/\w+/\w|(?:^|[\s\[(])[.~]?/\w|\.(?:cpp|cc|py|h):"), "a path or a file:line"),
            (re.compile(r"\brank:? ?\d|\[Rank \d|pid:? ?\d"), "a rank or pid"),
            (re.compile(r"\d\d:\d\d"), "a timestamp")]


@dataclass(frozen=True)
class Entry:
    message: str
    page: str          # "page.md#anchor" as linked from the index
    source: str = ""   # "file:line @ version" for the source table, else ""
    kind: str = ""     # "GPU only" / "older release" in the source table


def code_spans(text):
    return re.findall(r"`([^`\n]+)`", text)


def table_rows(markdown):
    """The body rows of every pipe table, as lists of cells (header and rule rows dropped)."""
    rows, previous = [], ""
    for line in markdown.splitlines():
        if line.startswith("|") and not re.match(r"^\|[ :|-]+\|$", line):
            if not previous.startswith("|"):
                previous = line          # header row
                continue
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            rows.append(cells)
        previous = line
    return rows


def parse_index(path=INDEX):
    """The entries of the index: each first-column code span of each table row, with the page
    its row links to. Rows of the source table also carry kind and source."""
    text = path.read_text()
    main, _, source = text.partition(SOURCE_TABLE_HEADING)
    entries = []
    for part, in_source_table in ((main, False), (source.split("\n## ")[0], True)):
        for cells in table_rows(part):
            links = re.findall(r"\]\(([^)]+)\)", cells[-1])
            assert links, f"index row without a page link: {cells}"
            for message in code_spans(cells[0]):
                message = message.replace("\\|", "|")
                if in_source_table:
                    entries.append(Entry(message, links[0], source=cells[2], kind=cells[1]))
                else:
                    entries.append(Entry(message, links[0]))
    return entries


def unstable_parts(message):
    return [why for pattern, why in UNSTABLE if pattern.search(message)]


@functools.lru_cache(maxsize=1)
def torch_corpus():
    """Every .py source of the installed torch (as bytes) and the bytes of its shared libraries,
    as one searchable blob per kind."""
    import torch  # noqa: PLC0415  (only when a check needs it)

    root = Path(torch.__file__).parent
    py = b"\n".join(p.read_bytes() for p in root.rglob("*.py"))
    so = b"\n".join(p.read_bytes() for p in (root / "lib").glob("*.so*"))
    return {"python sources": py, "shared libraries": so, "C/C++ runtime": runtime_libraries()}


def runtime_libraries():
    """The C and C++ runtime libraries this process (torch imported) has mapped: messages such
    as strerror texts and `terminate called ...` come from them, not from torch."""
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    names = sorted({line.split()[-1] for line in maps.splitlines()
                    if re.search(r"/lib(c|stdc\+\+)\.so[.\d]*$", line)})
    return b"\n".join(Path(n).read_bytes() for n in names)


def where_in_torch(message, formatted=False):
    """Which part of the installed torch contains `message` literally ("" when none). With
    `formatted`, a message whose values (numbers, true/false) torch fills in at run time also
    counts when its format string is there: `useIpv6: false` is printed from `useIpv6: {}`."""
    candidates = [message.replace("\\|", "|")]
    if formatted:
        candidates.append(re.sub(r"(?<![\w-])(?:false|true|-?\d+)\b", "{}", candidates[0]))
    for kind, blob in torch_corpus().items():
        if any(c.encode() in blob for c in candidates):
            return kind
    return ""


def quoted_lines(markdown):
    """Error messages a page quotes: lines of its code blocks, and its code spans, that read
    like an error (commands and code are skipped)."""
    quotes = []
    for fence, block in re.findall(r"```([^\n]*)\n(.*?)```", markdown, re.S):
        if fence.strip() in CODE_FENCES:
            continue
        for line in block.splitlines():
            if ERROR_WORDS.search(line) and not line.strip().startswith(COMMAND_START):
                quotes.append(line.strip())
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)
    quotes += [s for s in code_spans(prose) if len(s) >= 20 and ERROR_WORDS.search(s)
               and not s.startswith(COMMAND_START)]
    return quotes


def lesson_markdown(path):
    """The markdown cells of a py:percent lesson, as markdown."""
    cells = re.split(r"^# %%", path.read_text(), flags=re.M)
    md = [c for c in cells if c.startswith(" [markdown]")]
    return "\n".join(re.sub(r"^# ?", "", c, flags=re.M) for c in md)


def quoting_pages():
    """Every page whose quoted messages must be covered by the index: the runbooks (the index
    itself included) and the lessons' prose."""
    pages = {p.relative_to(ROOT).as_posix(): p.read_text()
             for p in sorted((ROOT / "runbooks").glob("*.md"))}
    for lesson in sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py")):
        pages[lesson.relative_to(ROOT).as_posix()] = lesson_markdown(lesson)
    return pages


@functools.lru_cache(maxsize=1)
def course_source_words():
    """The words of the course's own drills and labs, which raise messages of their own."""
    text = "\n".join(p.read_text() for pattern in COURSE_SOURCES for p in ROOT.glob(pattern))
    return " ".join(re.findall(r"[\w']+", text))


def is_course_message(quote):
    """A quote whose error message is one the course's drills or labs raise themselves
    (`RuntimeError: corrupt sample in shard 7`): four words of it in a row are in their
    source (numbers left out: they are filled in at run time)."""
    match = re.search(r"(?:Error|Exception): (.+)", quote)
    words = [w for w in re.findall(r"[\w']+", match.group(1)) if not w.isdigit()] if match else []
    windows = [" ".join(words[i:i + 4]) for i in range(len(words) - 3)]
    return any(window in course_source_words() for window in windows)


def uncovered_quotes(entries, pages):
    """(page, quote) for each quoted message that contains no index entry and is not one of
    the course's own messages."""
    messages = [e.message for e in entries]
    return [(name, quote) for name, text in pages.items() for quote in quoted_lines(text)
            if not any(m in quote for m in messages)
            and not PLACEHOLDER.search(quote) and not is_course_message(quote)]


if __name__ == "__main__":
    entries = parse_index()
    print(f"{len(entries)} entries")
    for entry in entries:
        found = where_in_torch(entry.message, formatted=True)
        print(f"{'SOURCE ' + entry.kind if entry.source else found or 'NOT FOUND':>24} | "
              f"{entry.message}")
    for name, quote in uncovered_quotes(entries, quoting_pages()):
        print(f"uncovered: {name}: {quote[:150]}", file=sys.stderr)
