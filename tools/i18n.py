"""The Chinese edition: which English page each Chinese page translates, and whether it still does.

Every page a reader reads has a Chinese counterpart under i18n/zh/, at the same path:
docs/onboarding.md -> i18n/zh/docs/onboarding.md, runbooks/x.md -> i18n/zh/runbooks/x.md,
lessons/NN_x.py -> i18n/zh/lessons/NN_x.py (the same Jupytext file with its markdown cells
translated and its code cells untouched), labs/labNN_x.py -> i18n/zh/labs/labNN_x.md (its
docstring, which the lab's page shows), and tools/templates/x.md (the prose of a generated page)
-> i18n/zh/tools/templates/x.md.

A translation must keep what people grep for and what the site links to: every fenced code
block and every inline code span, every link target, and the heading structure (the Chinese
headings get the English anchors at build time, so links into a page work in both languages).
It must use the glossary's terms (i18n/zh/terms.yml), not the variants it lists as avoided.

i18n/zh/sources.json records, per Chinese page, the sha256 of the English source it was
translated from. An English edit changes the hash, and tests/test_i18n.py names the page until
its translation is updated and stamped again.

Usage:
    python tools/i18n.py check [ZH_PATH ...]   structure, code, links, terms (default: all)
    python tools/i18n.py stamp ZH_PATH ...     record the English source's current hash
    python tools/i18n.py status                missing, stale and orphaned translations
"""

import ast
import hashlib
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ZH = ROOT / "i18n" / "zh"
SOURCES = ZH / "sources.json"
TERMS = ZH / "terms.yml"

FENCE = re.compile(r"^( *)(```|~~~).*?^\1\2[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+\S", re.M)
PLACEHOLDER = re.compile(r"(?<!\{)\{[a-z_]+\}(?!\})")
LESSON = re.compile(r"\d\d_\w+\.py")
LAB = re.compile(r"lab\d\d_\w+\.py")
COMMAND = re.compile(r"^\s*(torchrun |python |done \| |--rdzv)", re.M)


def english_sources():
    """Every English page a reader reads that is written by hand (generated pages are
    translated in the generator)."""
    pages = sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "runbooks").glob("*.md"))
    lessons = sorted(p for p in (ROOT / "lessons").glob("*.py") if LESSON.fullmatch(p.name))
    labs = sorted(p for p in (ROOT / "labs").glob("*.py") if LAB.fullmatch(p.name))
    templates = sorted((ROOT / "tools" / "templates").glob("*.md"))
    return pages + lessons + labs + templates


def is_lab(english):
    return english.parent.name == "labs" and LAB.fullmatch(english.name) is not None


def zh_path(english):
    relative = english.relative_to(ROOT)
    return ZH / (relative.with_suffix(".md") if is_lab(english) else relative)


def english_path(zh):
    relative = Path(zh).resolve().relative_to(ZH)
    if relative.parts[0] == "labs":
        return ROOT / relative.with_suffix(".py")
    return ROOT / relative


def lab_docstring(path):
    """A lab's module docstring as Python reads it (escapes such as a trailing \\ resolved)."""
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def source_text(english):
    """What the Chinese page translates: a lab's docstring (its code is not translated, so a
    code change does not make the translation stale), else the whole file."""
    return lab_docstring(english) if is_lab(english) else english.read_text()


def sha256(english):
    return hashlib.sha256(source_text(english).encode()).hexdigest()


def recorded_hashes():
    return json.loads(SOURCES.read_text()) if SOURCES.exists() else {}


def avoided_terms():
    import yaml

    return {variant: entry["zh"] for entry in yaml.safe_load(TERMS.read_text())
            for variant in entry.get("avoid", [])}


def without_fences(text):
    return FENCE.sub("", text)


def structure(text):
    """What a translation keeps: fenced blocks (in order), inline code spans and link targets
    (as multisets: Chinese word order may move them), heading levels (in order)."""
    prose = without_fences(text)
    return {"code blocks": [m.group(0).strip() for m in FENCE.finditer(text)],
            "code spans": Counter(m.group(0) for m in CODE_SPAN.finditer(prose)),
            "links": Counter(LINK.findall(CODE_SPAN.sub("", prose))),
            "placeholders": Counter(PLACEHOLDER.findall(CODE_SPAN.sub("", prose))),
            "heading levels": [len(m.group(1)) for m in HEADING.finditer(prose)]}


def difference(name, english, chinese):
    if english == chinese:
        return []
    if isinstance(english, Counter):
        missing, extra = english - chinese, chinese - english
        return [f"{name}: missing {sorted(missing)[:5]}" if missing else "",
                f"{name}: not in the English {sorted(extra)[:5]}" if extra else ""]
    if name == "code blocks":
        for i, (a, b) in enumerate(zip(english, chinese)):
            if a != b:
                return [f"code block {i + 1} differs from the English: {b[:80]!r}"]
        return [f"{len(chinese)} code blocks, the English has {len(english)}"]
    return [f"{name}: {chinese} but the English has {english}"]


def markdown_problems(english_text, chinese_text):
    ours, theirs = structure(english_text), structure(chinese_text)
    problems = [p for key in ours for p in difference(key, ours[key], theirs[key]) if p]
    for variant, preferred in avoided_terms().items():
        if variant in chinese_text:
            problems.append(f"uses {variant!r}: the glossary's term is {preferred!r}")
    return problems


def lesson_cells(path):
    import jupytext

    return [(c.cell_type, c.source) for c in jupytext.read(path).cells]


def lesson_problems(english, chinese):
    ours, theirs = lesson_cells(english), lesson_cells(chinese)
    if [t for t, _ in ours] != [t for t, _ in theirs]:
        return ["the cells differ from the English lesson's (same cells, same order)"]
    problems = []
    for i, ((kind, a), (_, b)) in enumerate(zip(ours, theirs), 1):
        if kind == "code" and a != b:
            problems.append(f"cell {i}: code differs from the English lesson's")
        elif kind == "markdown":
            problems += [f"cell {i}: {p}" for p in markdown_problems(a, b)]
    return problems


def docstring_problems(english, chinese_text):
    """A lab's docstring: its code spans, and its command and expected-output lines verbatim."""
    docstring = lab_docstring(english)
    problems = [p for p in markdown_problems(docstring, chinese_text)
                if not p.startswith("heading levels")]
    chinese_lines = {line.strip() for line in chinese_text.splitlines()}
    for line in docstring.splitlines():
        if COMMAND.match(line) and line.strip() not in chinese_lines:
            problems.append(f"command or output line missing or changed: {line.strip()[:80]!r}")
    return problems


def problems_of(zh):
    zh = Path(zh).resolve()
    english = english_path(zh)
    if not english.exists():
        return [f"no English source {english.relative_to(ROOT)}"]
    if is_lab(english):
        return docstring_problems(english, zh.read_text())
    if zh.suffix == ".py":
        return lesson_problems(english, zh)
    return markdown_problems(english.read_text(), zh.read_text())


def status():
    """(missing, stale, orphaned) paths relative to the repo."""
    recorded = recorded_hashes()
    missing, stale = [], []
    for english in english_sources():
        key = str(english.relative_to(ROOT))
        if not zh_path(english).exists():
            missing.append(key)
        elif recorded.get(key) != sha256(english):
            stale.append(key)
    orphaned = [str(p.relative_to(ROOT)) for p in sorted(ZH.rglob("*"))
                if p.suffix in (".md", ".py") and not english_path(p).exists()]
    return missing, stale, orphaned


def stamp(paths):
    recorded = recorded_hashes()
    for zh in paths:
        english = english_path(zh)
        recorded[str(english.relative_to(ROOT))] = sha256(english)
    SOURCES.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")


def main(argv):
    command, paths = (argv[0] if argv else "status"), argv[1:]
    if command == "check":
        paths = paths or [zh_path(e) for e in english_sources() if zh_path(e).exists()]
        bad = 0
        for zh in paths:
            for problem in problems_of(zh):
                bad += 1
                print(f"{Path(zh).resolve().relative_to(ROOT)}: {problem}")
        print(f"{len(paths)} pages checked, {bad} problems")
        return 1 if bad else 0
    if command == "stamp":
        stamp(paths)
        return 0
    missing, stale, orphaned = status()
    for label, items in [("missing", missing), ("stale", stale), ("orphaned", orphaned)]:
        print(f"{label}: {len(items)}" + "".join(f"\n  {item}" for item in items))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
