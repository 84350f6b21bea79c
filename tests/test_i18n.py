"""The Chinese edition stays in step with the English one (tools/i18n.py).

Every English page has its Chinese page and the reverse; a Chinese page records the hash of the
English source it translates, and goes stale (named here) when the English changes; a
translation keeps the code, the links and the headings, and uses the glossary's terms.
"""

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import i18n  # noqa: E402


def test_every_english_page_has_its_chinese_page_and_the_reverse():
    missing, _, orphaned = i18n.status()
    assert missing == [], f"no Chinese page for: {missing}"
    assert orphaned == [], f"Chinese pages whose English page is gone: {orphaned}"


def test_no_chinese_page_is_older_than_its_english_page():
    """Fix: update the translation, then `python tools/i18n.py stamp i18n/zh/<path>`."""
    _, stale, _ = i18n.status()
    assert stale == [], f"the English changed since these were translated: {stale}"


def test_translations_keep_code_links_and_headings_and_use_the_glossary():
    problems = [f"{zh.relative_to(REPO)}: {problem}"
                for english in i18n.english_sources()
                if (zh := i18n.zh_path(english)).exists()
                for problem in i18n.problems_of(zh)]
    assert problems == [], "\n".join(problems[:40])


def test_the_glossary_is_well_formed():
    terms = yaml.safe_load(i18n.TERMS.read_text())
    preferred = {t["zh"] for t in terms}
    for term in terms:
        assert set(term) <= {"en", "zh", "avoid", "allow"} and term["en"] and term["zh"], term
        for variant in term.get("avoid", []):
            # A variant inside a preferred term would flag every correct use of it.
            assert not any(variant in p for p in preferred), (variant, term)
        for pattern in term.get("allow", []):
            # An allowed context exempts uses of one of its entry's variants, and compiles.
            assert re.compile(pattern) and any(v in pattern for v in term["avoid"]), term


# (a calque, the same thing as a Chinese engineer writes it): issue 中文版, section 2.
CALQUES = [
    ("取每种调度的中位数稳定步", "取每种调度稳态下耗时居中的那一步"),
    ("中位数步时为 41 ms", "步耗时的中位数为 41 ms"),
    ("按墙钟时间测出的气泡", "按实际耗时（wall time）测出的气泡"),
    ("每个 worker 有 2 个在途 batch", "每个 worker 最多有 2 个 in-flight（已发出、尚未完成）的 batch"),
    ("与账本的预测完全一致", "与 ledger 的预测完全一致"),
    ("只要阶段足够重，气泡就落在公式上", "只要每个阶段的计算量足够大，气泡就落在公式上"),
]


@pytest.mark.parametrize("calque,natural", CALQUES)
def test_the_glossary_rejects_calques_and_passes_the_natural_wording(calque, natural):
    """A phrase that only makes sense through the English fails the check (naming it and its
    line); the wording it stands for passes. The real glossary, so removing an entry fails."""
    english = "One sentence.\n\nAnother.\n"
    problems = i18n.markdown_problems(english, f"一句话。\n\n{calque}。\n")
    assert problems and all("(line 3)" in p for p in problems), problems
    assert i18n.markdown_problems(english, f"一句话。\n\n{natural}。\n") == []


@pytest.mark.parametrize("text,rejected", [
    ("步时 41 ms", True),
    ("每步时间 41 ms", True),
    ("步耗时 41 ms", False),          # the glossary's term
    ("在第 10 步时崩溃", False),       # "at step 10": the entry's allow pattern
    ("第10步时", False),
    ("走到这一步时再看", False),
])
def test_step_time_calque_is_a_word_not_two_characters(text, rejected):
    assert bool(i18n.markdown_problems("Text.\n", text + "。\n")) is rejected


def test_search_segments_every_glossary_term_as_one_word():
    """jieba's user dictionary (mkdocs.zh.yml, search.jieba_dict_user) holds each Chinese
    term, so a search for it finds the pages that use it."""
    words = set(i18n.ZH.joinpath("search-words.txt").read_text().split())
    terms = yaml.safe_load(i18n.TERMS.read_text())
    wanted = {t["zh"] for t in terms if t["zh"] != "keep" and " " not in t["zh"]}
    assert wanted <= words, sorted(wanted - words)


@pytest.fixture
def tiny_course(tmp_path, monkeypatch):
    """A course of one page and its translation, with tools/i18n.py pointed at it."""
    (tmp_path / "docs").mkdir()
    english = tmp_path / "docs" / "page.md"
    english.write_text("# Title\n\nRun `torchrun --nproc-per-node 2 x.py`; see [it](b.md).\n\n"
                       "## Why\n\nBecause.\n")
    zh_root = tmp_path / "i18n" / "zh"
    (zh_root / "docs").mkdir(parents=True)
    (zh_root / "terms.yml").write_text("- {en: parallel, zh: 并行, avoid: [平行]}\n")
    monkeypatch.setattr(i18n, "ROOT", tmp_path)
    monkeypatch.setattr(i18n, "ZH", zh_root)
    monkeypatch.setattr(i18n, "SOURCES", zh_root / "sources.json")
    monkeypatch.setattr(i18n, "TERMS", zh_root / "terms.yml")
    chinese = zh_root / "docs" / "page.md"
    chinese.write_text("# 标题\n\n运行 `torchrun --nproc-per-node 2 x.py`；见[这里](b.md)。\n\n"
                       "## 为什么\n\n因为。\n")
    return english, chinese


def test_the_drift_check_names_a_page_whose_english_changed(tiny_course):
    english, chinese = tiny_course
    assert i18n.status() == ([], ["docs/page.md"], [])  # never stamped
    i18n.stamp([chinese])
    assert i18n.status() == ([], [], [])
    english.write_text(english.read_text() + "\nOne more sentence.\n")
    assert i18n.status() == ([], ["docs/page.md"], [])
    chinese.unlink()
    assert i18n.status() == (["docs/page.md"], [], [])


def test_the_checker_catches_changed_code_links_headings_and_avoided_terms(tiny_course):
    _, chinese = tiny_course
    good = chinese.read_text()
    assert i18n.problems_of(chinese) == []
    for broken, expected in [
        (good.replace("--nproc-per-node 2", "--nproc-per-node 4"), "code spans"),
        (good.replace("(b.md)", "(c.md)"), "links"),
        (good.replace("## 为什么", "### 为什么"), "heading levels"),
        (good.replace("因为。", "因为它是平行的。"), "平行"),
    ]:
        chinese.write_text(broken)
        assert any(expected in p for p in i18n.problems_of(chinese)), expected


def test_every_linked_page_goes_by_one_title():
    """A reader meets one Chinese name for one page: `tools/i18n.py check` names the link whose
    title (its text before any "：" or "，") differs from the other links to that page."""
    problems = [f"{zh.relative_to(REPO)}: {problem}" for zh, problem in i18n.link_title_problems()]
    assert problems == [], "\n".join(problems[:40])


def test_the_title_check_catches_a_second_name_for_a_page(tiny_course):
    _, chinese = tiny_course
    other = chinese.with_name("other.md")
    other.write_text("另见[这里：为什么](b.md#why)和 `[不算](b.md)`。\n")
    assert i18n.link_title_problems([chinese, other]) == []  # a section after "：" is fine
    other.write_text("另见[那一页](b.md)。\n")
    problems = i18n.link_title_problems([chinese, other, other])
    assert [zh.name for zh, _ in problems] == ["page.md"]  # the odd one out, not the usual title
    assert "calls it '这里'" in problems[0][1] and "call it '那一页'" in problems[0][1]


def test_a_lesson_translation_must_keep_every_code_cell(tmp_path, monkeypatch):
    english = REPO / "lessons" / "01_ddp.py"
    zh_root = tmp_path / "zh"
    target = zh_root / "lessons" / english.name
    target.parent.mkdir(parents=True)
    monkeypatch.setattr(i18n, "ZH", zh_root)
    text = english.read_text()
    code_line = next(line for line in text.splitlines() if line.startswith("import "))
    target.write_text(text.replace(code_line, code_line + "  # 注释译成中文", 1))
    assert i18n.problems_of(target) == []  # a translated comment is not a code change
    target.write_text(text.replace(code_line, code_line + ", json", 1))
    assert any("code differs" in p for p in i18n.problems_of(target))


@pytest.mark.parametrize("english,chinese,same", [
    ("x = f(1)  # one\n", "x = f(1)  # 一\n", True),
    ("# a two-line\n# comment\ny = 2\n", "# 一行注释\ny = 2\n", True),
    ("s = '# not a comment'\n", "s = '# 不是注释'\n", False),   # strings stay verbatim
    ("x = f(1)\n", "x = f(2)\n", False),
])
def test_python_code_is_compared_with_its_comments_set_aside(english, chinese, same):
    assert (i18n.python_code(english) == i18n.python_code(chinese)) is same


@pytest.mark.parametrize("english,chinese,same", [
    ("make course   # runs every lab\n", "make course   # 运行每个实验\n", True),
    ("# first\nmake test\n", "# 先运行\nmake test\n", True),
    ("curl http://x/#top\n", "curl http://x/#顶部\n", False),     # a # inside a word is code
    ("echo '# kept'\n", "echo '# 保留'\n", False),               # so is a quoted one
    ("torchrun --nproc-per-node 2 x.py\n", "torchrun --nproc-per-node 4 x.py\n", False),
])
def test_shell_code_is_compared_with_its_comments_set_aside(english, chinese, same):
    assert (i18n.shell_code(english) == i18n.shell_code(chinese)) is same


def test_a_fenced_block_in_another_language_stays_verbatim():
    english, chinese = "```text\nstep 1 # done\n```", "```text\nstep 1 # 完成\n```"
    assert i18n.code_block_key(english) != i18n.code_block_key(chinese)
    python = "```python title=\"self-check 4.1\"\nassert x  # why\n```"
    assert i18n.code_block_key(python) == i18n.code_block_key(python.replace("why", "为什么"))


def test_sources_file_lists_only_pages_that_exist():
    recorded = json.loads(i18n.SOURCES.read_text())
    assert all((REPO / path).exists() for path in recorded), recorded


def test_every_search_alias_is_explained_on_its_page():
    """An alias (i18n/zh/search-aliases.yml) leads a Chinese search to a page whose title rightly
    avoids the word: the page must exist and say the word in its text."""
    aliases = yaml.safe_load((i18n.ZH / "search-aliases.yml").read_text())
    assert aliases
    for entry in aliases:
        page = i18n.ZH / entry["page"]
        assert page.exists(), entry
        assert entry["alias"] in page.read_text(), entry
