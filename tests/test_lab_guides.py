"""Each lab's docstring ends with a "Use it in your project" block: what to replace, what to keep,
and the pitfalls, tied to the runbooks. The lab file travels alone into a project, so the block
must be right about that file: every function, class and flag it names exists there, every
runbook it cites exists here, and the format is the one the site generator parses. A lab travels
with its kit (labs/labkit/), so a name may live in either.

File-level only (no torchrun): it reads the lab sources as text.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LABS = sorted((REPO / "labs").glob("lab[0-9][0-9]_*.py"))
KIT = "\n".join(p.read_text() for p in sorted((REPO / "labs" / "labkit").glob("*.py")))
HEADER = "Use it in your project:"
BULLETS = ("Replace", "Keep", "Pitfalls")
MAX_LINES, MAX_COLUMNS = 14, 100


def docstring(source):
    """The text between the first pair of triple quotes, as tools/site_hooks.py reads it."""
    match = re.match(r'\s*"""(.*?)"""', source, re.S)
    return match.group(1) if match else ""


def parse_guide(doc):
    """The block's lines and {bullet: text}; ValueError naming the first format problem."""
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines) if line == HEADER]
    if len(starts) != 1:
        raise ValueError(f"expected one line {HEADER!r}, found {len(starts)}")
    start = starts[0]
    lesson = [i for i, line in enumerate(lines) if line.startswith("Lesson:")]
    if not lesson or lesson[0] > start:
        raise ValueError("the block must come after the 'Lesson: ... Runbooks: ...' line")
    if lines[start - 1].strip():
        raise ValueError("the block must follow an empty line")
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    block = lines[start:end]
    if len(block) > MAX_LINES:
        raise ValueError(f"{len(block)} lines, at most {MAX_LINES}")
    bullets = {}
    for number, line in enumerate(block[1:], start + 2):
        match = re.match(r"  - (\w+): (\S.*)$", line)
        if match:
            bullets[match.group(1)] = match.group(2)
        elif re.match(r"    \S", line) and bullets:
            last = list(bullets)[-1]
            bullets[last] += " " + line.strip()
        else:
            raise ValueError(f"docstring line {number} is neither a bullet at column 2 nor a "
                             f"continuation indented 4 spaces: {line!r}")
    if tuple(bullets) != BULLETS:
        raise ValueError(f"bullets {tuple(bullets)}, expected exactly {BULLETS} in that order")
    for number, line in enumerate(block, start + 1):
        if len(line) > MAX_COLUMNS:
            raise ValueError(f"docstring line {number} has {len(line)} columns")
        if not line.isascii():
            raise ValueError(f"docstring line {number} is not ASCII")
    return block, bullets


def lab_flags(source):
    return set(re.findall(r'(?:arg|add_argument)\(\s*"(--[a-z0-9-]+)"', source))


def reference_problems(text, source):
    """Names, flags and runbook paths in `text` that `source` (a lab) or the repo lacks."""
    problems = []
    for token in re.findall(r"`([^`]+)`", text):
        call = re.fullmatch(r"([A-Za-z_]\w*)\(\)", token)
        if call and not re.search(rf"^\s*def {call.group(1)}\(", source, re.M):
            problems.append(f"`{token}`: no def {call.group(1)}( in the lab")
        elif re.fullmatch(r"[A-Z]\w*", token) and not re.search(rf"^class {token}\b", source,
                                                                 re.M):
            problems.append(f"`{token}`: no class {token} in the lab")
        elif not call and not token.startswith("--") and not re.fullmatch(r"[A-Z]\w*", token) \
                and token not in source:
            problems.append(f"`{token}`: this code does not occur in the lab")
    flags = lab_flags(source)
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text):
        if flag not in flags:
            problems.append(f"{flag}: not a flag of the lab")
    for page in re.findall(r"runbooks/[\w./-]+?\.md", text):
        if not (REPO / page).is_file():
            problems.append(f"{page}: no such runbook")
    return problems


def check_guide(source):
    """Every problem of the lab's guide block, as strings; [] when it is right."""
    try:
        block, bullets = parse_guide(docstring(source))
    except ValueError as exc:
        return [str(exc)]
    problems = reference_problems("\n".join(block), source + "\n" + KIT)
    if not re.search(r"runbooks/[\w./-]+?\.md", bullets["Pitfalls"]):
        problems.append("Pitfalls cites no runbook")
    return problems


def test_there_are_labs_to_check():
    assert len(LABS) >= 4, [p.name for p in LABS]


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_guide_block_is_well_formed_and_cites_what_exists(lab):
    assert check_guide(lab.read_text()) == []


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_guide_names_the_labs_own_code(lab):
    """Not just well formed: each bullet names at least one function or class of this lab,
    and the Replace bullet names the model builder."""
    source = lab.read_text()
    _, bullets = parse_guide(docstring(source))
    for name, text in bullets.items():
        names = re.findall(r"`([A-Za-z_]\w*)\(\)`|`([A-Z]\w*)`", text)
        assert names, f"{name} names no function or class of {lab.name}"
    assert "`build_model()`" in bullets["Replace"]


def broken_variants(source):
    """One deliberately broken copy of a real lab per rule, with the problem it must report."""
    doc = docstring(source)
    block, _ = parse_guide(doc)
    text = "\n".join(block)

    def swap(old, new, where=text):
        assert old in where, old
        return source.replace(doc, doc.replace(where, where.replace(old, new, 1)))

    keep_line = next(line for line in block if line.startswith("  - Keep: "))
    return {
        "missing header": (swap(HEADER, "Use it in your code:"), "expected one line"),
        "bullets out of order": (swap("  - Replace: ", "  - Pitfalls: ").replace(
            "  - Pitfalls: a", "  - Replace: a", 1), "in that order"),
        "bullet dropped": (swap(keep_line, keep_line.replace("  - Keep: ", "    ")),
                           "in that order"),
        "bad indent": (swap("\n    ", "\n     "), "continuation indented 4 spaces"),
        "empty line inside": (swap("\n  - Keep: ", "\n\n  - Keep: "), "in that order"),
        "line too wide": (swap(keep_line, keep_line + " " + "x" * 100), "columns"),
        "too many lines": (swap(keep_line, keep_line + "\n    x" * 3), "at most 14"),
        "invented function": (swap("`build_model()`", "`build_net()`"), "no def build_net("),
        "invented class": (swap("`SyntheticSequences`", "`SyntheticTokens`"),
                           "no class SyntheticTokens"),
        "invented flag": (swap("`--", "`--no-such-"), "not a flag of the lab"),
        "missing runbook": (swap("runbooks/", "runbooks/missing-"), "no such runbook"),
        "non-ASCII": (swap(" - Replace:", " - Replace: \u2014"), "not ASCII"),
    }


@pytest.mark.parametrize("case", ["missing header", "bullets out of order", "bullet dropped",
                                  "bad indent", "empty line inside", "line too wide",
                                  "too many lines",
                                  "invented function", "invented class", "invented flag",
                                  "missing runbook", "non-ASCII"])
def test_the_checker_rejects_a_broken_guide(case):
    source = (REPO / "labs" / "lab01_ddp.py").read_text()
    assert check_guide(source) == []  # the unbroken original passes
    broken, expected = broken_variants(source)[case]
    assert broken != source
    problems = check_guide(broken)
    assert any(expected in p for p in problems), problems
