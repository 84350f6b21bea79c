"""Every command a page tells the reader to run exists, with flags that exist.

Scans the code blocks of README.md, docs/, runbooks/ and the lessons' markdown for
`torchrun ...` and `python <script>.py ...` lines, then checks the script is in the repo and
every `--flag` is accepted by the script's argparse parser (or by torchrun's own parser).
"""

import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from launcher import help_texts

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def pages():
    found = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")),
             *sorted((REPO / "runbooks").glob("*.md"))]
    return [p for p in found if p.exists()]


def command_lines(text):
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)  # shell line continuations
        for line in joined.splitlines():
            line = line.split(" #")[0].strip().lstrip("$ ").strip()
            if re.match(r"^(\S+=\S+\s+)*(torchrun|python3?|\S*/python3?)\s", line):
                yield line


def parse_command(line):
    words = [w for w in shlex.split(line, comments=True) if "=" not in w or w.startswith("-")]
    while words and "=" in words[0] and not words[0].startswith("-"):
        words.pop(0)
    launcher, rest = words[0], words[1:]
    if launcher != "torchrun":
        if rest[:1] == ["-m"]:
            return None  # python -m <module>: checked by running, not here
        return None, rest[0] if rest else None, rest[1:]
    torchrun_flags, script_index = [], None
    for i, word in enumerate(rest):
        if word.endswith(".py"):
            script_index = i
            break
        torchrun_flags.append(word)
    if script_index is None:
        return torchrun_flags, None, []
    return torchrun_flags, rest[script_index], rest[script_index + 1:]


def script_commands():
    """(script, *subcommand) for every `python script ...` or `torchrun ... script ...` line
    of every page whose script exists: each needs its --help (and its subcommand's)."""
    for page in pages():
        for line in command_lines(page.read_text()):
            parsed = parse_command(line)
            if parsed is None or not parsed[1] or not (REPO / parsed[1]).is_file():
                continue
            _, script, args = parsed
            yield (script,)
            if args and not args[0].startswith("-"):
                yield (script, args[0])


@lru_cache(maxsize=None)
def help_of_every_page_command():
    """All the --help texts the pages need, printed by one interpreter (launcher.help_texts)."""
    return help_texts([(REPO / script, *words) for script, *words in set(script_commands())])


def script_flags(script, subcommand=None):
    """Flags in the script's --help (and its subcommand's, for scripts that have them)."""
    command = (REPO / script, *([subcommand] if subcommand else []))
    key = " ".join(map(str, command))
    texts = help_of_every_page_command()
    help_text = texts[key] if key in texts else help_texts([command])[key]
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text))


def torchrun_flags():
    flags = set()
    for action in get_args_parser()._actions:  # the parser torchrun itself uses
        flags.update(action.option_strings)
    return flags


def all_commands():
    for page in pages():
        for line in command_lines(page.read_text()):
            yield pytest.param(page, line, id=f"{page.relative_to(REPO)}:{line[:60]}")


@pytest.mark.parametrize("page,line", list(all_commands()))
def test_command_and_flags_exist(page, line):
    parsed = parse_command(line)
    if parsed is None:
        return
    launcher_flags, script, script_args = parsed
    if launcher_flags is not None:
        unknown = {f.split("=")[0] for f in launcher_flags if f.startswith("--")} - torchrun_flags()
        assert not unknown, f"torchrun has no {unknown}"
    if script is None or not script.endswith(".py") or "/" not in script:
        return  # e.g. `python -c`, or a script the reader writes themselves
    assert (REPO / script).exists(), f"{script} named in {page.name} does not exist"
    wanted = {a.split("=")[0] for a in script_args if a.startswith("--")}
    known = script_flags(script)
    if script_args and not script_args[0].startswith("-"):
        known |= script_flags(script, script_args[0])
    missing = wanted - known
    assert not missing, f"{script} has no {missing}"


def test_the_scanner_finds_commands_and_catches_bad_flags():
    text = "```bash\ntorchrun --nproc-per-node 2 labs/lab01_ddp.py \\\n    --no-such-flag\n```\n"
    (line,) = command_lines(text)
    _, script, args = parse_command(line)
    assert script == "labs/lab01_ddp.py"
    assert "--no-such-flag" not in script_flags(script) and "--steps" in script_flags(script)
    assert "--nproc-per-node" in torchrun_flags() and "--rdzv_id" in torchrun_flags()
