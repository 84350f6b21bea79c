"""The Chinese edition of the site: what the hooks (tools/site_hooks.py) do differently for it.

The English site builds from docs/, runbooks/, lessons/ and labs/; the Chinese one (mkdocs.zh.yml,
into site/zh/) from their translations under i18n/zh/ (tools/i18n.py keeps them in step):

- a Chinese heading gets the English heading's anchor, so every link into a page (and every
  link a reader copies) works in both languages;
- a Chinese lesson is the English executed notebook with its markdown cells swapped for the
  translated ones: the same code and the same outputs, executed once;
- every page carries a language switcher that leads to the same page in the other language.
"""

import json
import re
from pathlib import Path

import markdown

import i18n  # tools/i18n.py: where each translation lives, and what it must keep

ROOT = Path(__file__).resolve().parents[1]
ZH = i18n.ZH
EXECUTED_ZH_ROOT = ROOT / "build" / "executed-zh"
HEADING_LINE = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)

# The words the hooks write on generated pages and in the nav.
WORDS = {
    "en": {"Home": "Home", "Start here": "Start here", "Lessons": "Lessons", "Labs": "Labs",
           "Exercises": "Exercises", "Runbooks": "Runbooks", "Reference": "Reference",
           "Not in the index yet": "Not in the index yet"},
    "zh": {"Home": "首页", "Start here": "从这里开始", "Lessons": "课程", "Labs": "实验",
           "Exercises": "练习", "Runbooks": "排障手册", "Reference": "参考", "Not in the index yet": "尚未列入索引"},
}
LANGUAGES = [("en", "English"), ("zh", "简体中文")]


def language(config):
    return config.theme.get("language") or "en"


def words(config):
    return WORDS[language(config)]


# --- anchors -----------------------------------------------------------------------------

def heading_ids(markdown_text, config):
    """The anchors the English build gives the headings of a page, in document order."""
    md = markdown.Markdown(extensions=config.markdown_extensions,
                           extension_configs=config.mdx_configs)
    md.convert(markdown_text)

    def walk(tokens):
        for token in tokens:
            yield token["id"]
            yield from walk(token["children"])
    return list(walk(md.toc_tokens))


def with_english_anchors(chinese_markdown, english_markdown, config, page_name):
    """The Chinese page with ` {#english-id}` after each heading (attr_list), in order."""
    ids = heading_ids(english_markdown, config)
    fences = [(m.start(), m.end()) for m in i18n.FENCE.finditer(chinese_markdown)]
    headings = [m for m in HEADING_LINE.finditer(chinese_markdown)
                if not any(a <= m.start() < b for a, b in fences)]
    if len(headings) != len(ids):
        raise ValueError(f"{page_name}: {len(headings)} headings, the English page has "
                         f"{len(ids)} (tools/i18n.py check)")
    out, last = [], 0
    for match, anchor in zip(headings, ids):
        out += [chinese_markdown[last:match.end()], f" {{#{anchor}}}"]
        last = match.end()
    return "".join(out) + chinese_markdown[last:]


def terms_section():
    """The Chinese glossary page's table of terms, from the glossary file the tests enforce
    (i18n/zh/terms.yml), so the reader sees exactly the terms the pages must use."""
    import yaml

    rows = ["## 中英术语对照 {#terms}", "",
            "本表由 `i18n/zh/terms.yml` 生成：中文版各页只用这里的译法，测试会拒绝“不用”一栏里的"
            "写法。“保留英文”表示中文页面直接写英文原词。", "",
            "| English | 中文 | 不用 |", "|---|---|---|"]
    for term in yaml.safe_load(i18n.TERMS.read_text()):
        chinese = "保留英文" if term["zh"] == "keep" else term["zh"]
        rows.append(f"| {term['en']} | {chinese} | {'、'.join(term.get('avoid', []))} |")
    return "\n".join(rows) + "\n"


# --- lessons -----------------------------------------------------------------------------

def zh_notebook(lesson, english_notebook):
    """The English executed notebook with the Chinese cells: the same code (its comments
    translated: tools/i18n.py checks that only they differ) and the same outputs."""
    import jupytext

    chinese = jupytext.read(i18n.zh_path(Path(lesson))).cells
    notebook = json.loads(Path(english_notebook).read_text())
    cells = notebook["cells"]
    if [c["cell_type"] for c in cells] != [c.cell_type for c in chinese]:
        raise ValueError(f"{i18n.zh_path(Path(lesson)).relative_to(ROOT)}: its cells are not the "
                         "English lesson's (tools/i18n.py check)")
    for cell, translated in zip(cells, chinese):
        cell["source"] = translated.source  # prose, and code with its comments translated
    target = EXECUTED_ZH_ROOT / "lessons" / Path(english_notebook).name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(notebook, ensure_ascii=False, indent=1))
    return target


def notebook_heading_ids(notebook_path):
    """The heading ids mkdocs-jupyter renders for a notebook's markdown cells, in order."""
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    import mkdocs_jupyter.convert  # noqa: F401  (its import patches the heading renderer)

    cells = json.loads(Path(notebook_path).read_text())["cells"]
    ids = []
    for cell in cells:
        if cell["cell_type"] == "markdown":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            html = markdown2html_mistune(source)
            ids += re.findall(r"<h[1-6][^>]*\bid=\"([^\"]*)\"", html)
    return ids


HTML_HEADING = re.compile(r"<(h[1-6])([^>]*?)\bid=\"([^\"]*)\"(.*?)</\1>", re.S)


def lesson_with_english_anchors(html, toc, english_ids, page_name):
    """Give the rendered Chinese lesson's headings, and its table of contents, the English ids."""
    found = list(HTML_HEADING.finditer(html))
    if len(found) != len(english_ids):
        raise ValueError(f"{page_name}: {len(found)} headings, the English lesson has "
                         f"{len(english_ids)}")
    out, last = [], 0
    renamed = {}
    for match, anchor in zip(found, english_ids):
        tag, before, old, rest = match.groups()
        renamed.setdefault(old, anchor)
        rest = rest.replace(f'href="#{old}"', f'href="#{anchor}"')
        out += [html[last:match.start()], f'<{tag}{before}id="{anchor}"{rest}</{tag}>']
        last = match.end()
    html = "".join(out) + html[last:]
    links = list(flatten_toc(toc))
    for link, anchor in zip(links, english_ids):
        link.id = anchor
    return html


def flatten_toc(items):
    for item in items:
        yield item
        yield from flatten_toc(item.children)


# --- the language switcher ---------------------------------------------------------------

def alternate_links(page_url, config):
    """material's language selector, pointing at this page in each language, relative to the
    page (tools/site_theme/partials/alternate.html uses the links as given), so it works from
    file:// too: the Chinese site is the zh/ folder of the English one."""
    here = language(config)
    to_root = "../" * page_url.count("/")
    links = []
    for code, name in LANGUAGES:
        if code == here:
            link = page_url.rsplit("/", 1)[-1]
        elif here == "en":
            link = f"{to_root}{code}/{page_url}"
        else:
            link = f"{to_root}../{page_url}"
        links.append({"name": name, "link": link, "lang": code})
    return links
