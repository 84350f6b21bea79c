"""The onboarding week, measured: what each step of docs/onboarding.md costs to read and run.

Reading: the words of every page a step of "The path" links to, of the files it names in code
spans (the lessons' worker modules), and of its exercises in docs/onboarding-exercises.md,
converted at WORDS_PER_MINUTE. Running: the measured seconds of the timing table ("How long
things take") for the step's lesson and for every command the step gives. "Your week" plans
the days from these figures; tests/test_onboarding.py holds its table to them.

    python tools/onboarding_week.py            # one line per step and per day of the table
    python tools/onboarding_week.py --write    # put the figures into both tables (en and zh)

After --write, restamp the translation: python tools/i18n.py stamp i18n/zh/docs/onboarding.md
"""

import re
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "docs" / "onboarding.md"
BOOK = ROOT / "docs" / "onboarding-exercises.md"
ZH_PLAN = ROOT / "i18n" / "zh" / "docs" / "onboarding.md"

# Technical prose with code, read to be understood, not skimmed: 150 words a minute, below the
# 200 to 250 usually quoted for plain prose.
WORDS_PER_MINUTE = 150
# A day of onboarding is about 6 focused hours, and reading and running take at most 2 of them:
# the rest goes to what nobody has timed yet (the exercises, the drill reports, the graded
# exercises), which the week plan must leave room for.
DAY_BUDGET_MIN = 120
# Pages a step links as somewhere to look things up, not to read through.
LOOKUP_PAGES = {"runbooks/errors.md"}  # the error index: one row per message
# The capstones are no steps of the path: each has its reading, its runs, and the step it
# follows. The mid-course one: two ports, each graded once, after step 7's error pages. The
# final one: one port, graded, after the last step.
CAPSTONES = {
    "capstone": {
        "pages": ["onboarding-exercises.md#capstone-port-this-script", "capstone/train_plain.py"],
        "runs": {"python capstone/train_plain.py --out runs/plain": 1,
                 "python capstone/grade.py tests/capstone/port_fsdp2.py": 2},
        "after": 7},
    "final capstone": {
        "pages": ["onboarding-exercises.md#final-capstone-2-d-with-resume",
                  "capstone/train_transformer.py"],
        "runs": {"python capstone/train_transformer.py --out runs/lm --stop-at-step 6": 1,
                 "python capstone/train_transformer.py --out runs/lm": 1,
                 "python capstone/grade.py --final tests/capstone/port_2d.py": 1},
        "after": "last"},
}

LINK = re.compile(r"\]\(([^)\s]+)\)")
FILE_SPAN = re.compile(r"`((?:lessons|labs|capstone)/[\w/]+\.py)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
STEP = re.compile(r"^\*\*Step (\d+): ", re.M)
TIMING_ROW = re.compile(r"^\| (.+?) \| `(.+?)` \| (\d+) s \|$", re.M)


def count_words(text):
    """Words a reader reads: whitespace-separated runs with a letter or a digit (so markdown's
    `|`, `#` and `---` are not words). HTML comments (hidden wrong answers) are not read."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return sum(1 for word in text.split() if re.search(r"[^\W_]", word))


def anchor_of(heading):
    """The anchor mkdocs gives a heading: its toc extension's own slugify, on the heading's
    text as rendered (code and emphasis marks dropped)."""
    return slugify(re.sub(r"[`*]", "", heading), "-")


def section(text, anchor):
    """The heading whose anchor is `anchor`, and everything up to the next heading of the same
    or a higher level."""
    for match in re.finditer(r"^(#+) (.+)$", text, re.M):
        if anchor_of(match.group(2)) == anchor:
            level = len(match.group(1))
            end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, match.end())
            return text[match.start():end.start() if end else len(text)]
    raise ValueError(f"no heading with the anchor #{anchor}")


def source_of(target):
    """The repo file a link from docs/onboarding.md shows, or a repo path named in a code span:
    a lesson's notebook is its Jupytext source, a lab's page its source file."""
    path = target.split("#")[0]
    if m := re.fullmatch(r"lessons/(\d\d_\w+)\.ipynb", path):
        return ROOT / "lessons" / f"{m.group(1)}.py"
    if m := re.fullmatch(r"labs/(lab\d\d_\w+)\.md", path):
        return ROOT / "labs" / f"{m.group(1)}.py"
    if re.fullmatch(r"(runbooks|lessons|labs|capstone|exercises)/.+", path):
        return ROOT / path
    return ROOT / "docs" / path


def words_of(target):
    text = source_of(target).read_text()
    _, _, anchor = target.partition("#")
    return count_words(section(text, anchor) if anchor else text)


def steps():
    """{step number: its text in "The path"}, from its bold "Step N:" to the next one."""
    path = section(PLAN.read_text(), "the-path")
    starts = list(STEP.finditer(path))
    ends = [m.start() for m in starts[1:]] + [len(path)]
    return {int(m.group(1)): path[m.start():end] for m, end in zip(starts, ends)}


def exercise_anchors(step_text):
    """Links to the book's exercise sections that the step hands in."""
    handed_in = re.findall(r"\d+\.\d+", " ".join(
        re.findall(r"Hand in\s+exercises?\s+([0-9.,\sand]+)", step_text)))
    headings = re.findall(r"^### (Exercise (\d+\.\d+): .+)$", BOOK.read_text(), re.M)
    anchor = {ex_id: anchor_of(title) for title, ex_id in headings}
    return [f"onboarding-exercises.md#{anchor[ex_id]}" for ex_id in handed_in]


def step_pages(step):
    """What step `step` (or a capstone) gives to read, in order, each once."""
    if step in CAPSTONES:
        return list(CAPSTONES[step]["pages"])
    text = steps()[step]
    prose = FENCE.sub("", text)
    pages = [t for t in LINK.findall(prose) if not t.startswith("#") and t not in LOOKUP_PAGES]
    pages += FILE_SPAN.findall(prose)
    pages += exercise_anchors(text)
    if step == min(s for s, t in steps().items() if "Hand in" in t):
        pages.append("onboarding-exercises.md#how-the-exercises-work")  # once, before the first
    return list(dict.fromkeys(pages))


def timings():
    """{command: measured seconds} of the timing table."""
    return {command: int(seconds) for _, command, seconds in TIMING_ROW.findall(PLAN.read_text())}


def step_runs(step):
    """({command: times run} the step runs, its lesson first), from the step's code blocks."""
    if step in CAPSTONES:
        return dict(CAPSTONES[step]["runs"])
    text = steps()[step]
    runs = {f"pytest lessons/{name}.py -q": 1
            for name in re.findall(r"\]\(lessons/(\d\d_\w+)\.ipynb\)", text)}
    for block in FENCE.findall(text):
        for line in re.sub(r"\s*\\\n\s*", " ", block).splitlines():  # join continuations
            if line.strip():
                runs[line.strip()] = runs.get(line.strip(), 0) + 1
    return runs


def day_cost(day_steps):
    """(words, reading minutes, measured run seconds, commands not timed) of a day's steps."""
    table = timings()
    pages, runs = [], {}
    for step in day_steps:
        pages += step_pages(step)
        for command, times in step_runs(step).items():
            runs[command] = runs.get(command, 0) + times
    words = sum(words_of(page) for page in dict.fromkeys(pages))
    seconds = sum(table[c] * n for c, n in runs.items() if c in table)
    untimed = [c for c in runs if c not in table]
    return words, round(words / WORDS_PER_MINUTE), seconds, untimed


def minutes_of(day_steps):
    """Reading and running minutes of a day's steps, unrounded."""
    words, _, seconds, _ = day_cost(day_steps)
    return words / WORDS_PER_MINUTE + seconds / 60


def plan_days():
    """[[steps of day 1], ...] in path order: a step joins the day before while the day still
    reads and runs within DAY_BUDGET_MIN. A capstone, mostly porting and grading, takes a day
    of its own after the step it follows (the mid-course one after step 7, whose error pages it
    exercises; the final one after the last)."""
    order = list(steps())
    for name, capstone in CAPSTONES.items():
        after = order.index(capstone["after"]) if capstone["after"] != "last" else len(order) - 1
        order.insert(after + 1, name)
    days = []
    for step in order:
        joins = (days and not CAPSTONES.keys() & {step, *days[-1]}
                 and minutes_of(days[-1] + [step]) <= DAY_BUDGET_MIN)
        if joins:
            days[-1].append(step)
        else:
            days.append([step])
    return days


# How each page's week table writes the figures: its "read" cell, and the start of its "run"
# cell (what follows, the names of the untimed commands, is the page's own text).
FIGURES = {
    PLAN: {"read": "{words:,} words: {minutes} min",
           "seconds": lambda s: f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s",
           "untimed": " + {n} not timed",
           "run": r"(?:\d+ min )?\d+ s(?: \+ \d+ not timed)?"},
    ZH_PLAN: {"read": "{words:,} 词：{minutes} 分钟",
              "seconds": lambda s: f"{s // 60} 分 {s % 60} 秒" if s >= 60 else f"{s} 秒",
              "untimed": "，另有 {n} 条命令尚未计时",
              "run": r"(?:\d+ 分 )?\d+ 秒(?:，另有 \d+ 条命令尚未计时)?"},
}


def format_seconds(seconds):
    return FIGURES[PLAN]["seconds"](seconds)


def table_lines(text):
    """(start, end) offsets of the week table's rows: the page's only rows whose first cell is
    a number (the day)."""
    return [m.span() for m in re.finditer(r"^\| \d+ \| .*$", text, re.M)]


def write_figures(page):
    """Put the measured figures into the week table of `page`, row by row (day n of the table
    is day n of plan_days()). Refuses when the days themselves changed: that needs a person."""
    fmt, text = FIGURES[page], page.read_text()
    days, spans = plan_days(), table_lines(text)
    if len(days) != len(spans):
        raise SystemExit(f"{page}: {len(spans)} days in the table, {len(days)} planned: "
                         "the days changed, rewrite the table's rows by hand")
    for day_steps, (start, end) in reversed(list(zip(days, spans))):
        words, minutes, seconds, untimed = day_cost(day_steps)
        cells = text[start:end].split(" | ")
        cells[2] = fmt["read"].format(words=words, minutes=minutes)
        run = fmt["seconds"](seconds) + (fmt["untimed"].format(n=len(untimed)) if untimed else "")
        cells[3] = re.sub(fmt["run"], lambda _: run, cells[3], count=1)
        text = text[:start] + " | ".join(cells) + text[end:]
    page.write_text(text)


def main(argv):
    if argv == ["--write"]:
        for page in FIGURES:
            write_figures(page)
        return 0
    for step in [*steps(), *CAPSTONES]:
        words, minutes, seconds, untimed = day_cost([step])
        print(f"step {step!s:>8}: {words:6,} words, {minutes:4d} min to read, {seconds:4d} s "
              f"to run" + (f", not timed: {untimed}" if untimed else ""))
    print(f"\nThe week's figures ({WORDS_PER_MINUTE} words a minute, at most "
          f"{DAY_BUDGET_MIN} min of reading and running a day):")
    for day, day_steps in enumerate(plan_days(), 1):
        words, minutes, seconds, untimed = day_cost(day_steps)
        print(f"day {day}: steps {', '.join(map(str, day_steps))} | {words:,} words: "
              f"{minutes} min | {format_seconds(seconds)}"
              + (f" + {len(untimed)} not timed" if untimed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
