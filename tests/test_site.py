"""The published site: builds with --strict, has no broken internal links or anchors, and renders
in a real headless browser with the lessons' executed outputs and plots.

Runs after the lessons (testpaths order), so the build reuses the notebooks nbval just executed.
"""

import html
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from pasted_log_lines import PASTED_LOG_LINES

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site():
    """Both editions, built by the README's `make site`: English in site/, Chinese in site/zh/."""
    proc = subprocess.run(["make", "--no-print-directory", "site", f"PY={sys.executable}"],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"site build: {proc.stdout.strip()}")  # the build time of each language
    return REPO / "site"


class LinkCollector(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])


def parse(page):
    collector = LinkCollector()
    collector.feed(page.read_text(errors="replace"))
    return collector


def broken_links(site_dir):
    pages = {p: parse(p) for p in site_dir.rglob("*.html")}
    parsed_targets = {}
    broken = []
    for page, parsed in pages.items():
        for href in parsed.links:
            url = urlsplit(href)
            if url.scheme or href.startswith(("//", "mailto:")):
                continue  # external: not checked offline
            if not url.path:
                target = page
            elif url.path.startswith("/"):  # site-absolute (the 404 page uses these)
                target = (site_dir / unquote(url.path).lstrip("/")).resolve()
            else:
                target = (page.parent / unquote(url.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_relative_to(site_dir.resolve()):  # the repository, not the site
                broken.append(f"{page.relative_to(site_dir)} -> {href} (outside the site)")
            elif not target.exists():
                broken.append(f"{page.relative_to(site_dir)} -> {href}")
            elif url.fragment and target.suffix != ".html":  # a download has no sections
                broken.append(f"{page.relative_to(site_dir)} -> {href} (an anchor into a file)")
            elif url.fragment:
                if target not in parsed_targets:  # parse each page once, not once per link
                    parsed_targets[target] = pages.get(target) or parse(target)
                if url.fragment not in parsed_targets[target].ids:
                    broken.append(f"{page.relative_to(site_dir)} -> {href} (no such anchor)")
    return broken


@pytest.mark.parametrize("edition", ["", "zh"])
def test_every_section_is_built(site, edition):
    root = site / edition
    assert (root / "index.html").exists()
    assert (root / "lessons" / "01_ddp.html").exists()
    assert (root / "labs" / "lab01_ddp.html").exists()
    assert (root / "runbooks" / "index.html").exists()


def html_pages(root):
    """The pages of one edition (the English site's zh/ folder is the other edition)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.html")
                  if p.relative_to(root).parts[0] != "zh")


def test_both_editions_have_the_same_pages(site):
    english, chinese = html_pages(site), html_pages(site / "zh")
    assert len(english) >= 30 and english == chinese


def switcher_links(page):
    return dict(re.findall(r'<a href="([^"]*)" hreflang="(en|zh)"', page.read_text()))


@pytest.mark.parametrize("edition, other", [("", "zh"), ("zh", "")])
def test_every_page_switches_to_the_same_page_in_the_other_language(site, edition, other):
    """The language selector of each page leads to its counterpart, by a relative link (so
    it works from file:// too). 404.html has none: it is served from any path."""
    wrong = []
    for path in html_pages(site / edition):
        if path == "404.html":
            continue
        links = {lang: href for href, lang in switcher_links(site / edition / path).items()}
        target = (site / edition / path).parent / links.get(other or "en", "missing")
        if "://" in links.get(other or "en", "") or target.resolve() != (site / other / path):
            wrong.append(f"{edition or 'en'}/{path} -> {links}")
    assert wrong == []


def code_and_outputs(notebook_path):
    """Each code cell's code, its comments set aside (the Chinese cells translate theirs), and
    its outputs."""
    import i18n  # tools/i18n.py

    cells = json.loads(notebook_path.read_text())["cells"]
    return [(i18n.python_code("".join(c["source"])), c.get("outputs"))
            for c in cells if c["cell_type"] == "code"]


def heading_ids(page):
    return re.findall(r'<h[1-6][^>]*\bid="([^"]*)"', page)


LESSONS = sorted(p.stem for p in (REPO / "lessons").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("lesson", LESSONS)
def test_a_chinese_lesson_has_the_english_code_outputs_and_anchors(site, lesson):
    """Executed once: the Chinese lesson is the English notebook with translated prose and
    comments, so its code, outputs (plots included) and heading anchors are the English
    page's."""
    english_nb = REPO / "build" / "executed" / "lessons" / f"{lesson}.ipynb"
    chinese_nb = REPO / "build" / "executed-zh" / "lessons" / f"{lesson}.ipynb"
    assert code_and_outputs(english_nb) == code_and_outputs(chinese_nb)
    assert any(outputs for _, outputs in code_and_outputs(chinese_nb))
    english = (site / "lessons" / f"{lesson}.html").read_text()
    chinese = (site / "zh" / "lessons" / f"{lesson}.html").read_text()
    assert chinese.count("data:image/png;base64") == english.count("data:image/png;base64")
    assert heading_ids(chinese) == heading_ids(english)
    assert re.search(r"[\u4e00-\u9fff]{12}", chinese)  # the prose is the Chinese one


def test_no_broken_internal_links_or_anchors(site):
    assert broken_links(site) == []


def test_link_checker_catches_a_broken_link(tmp_path):
    (tmp_path / "a.html").write_text('<a href="b.html">x</a><a href="a.html#nope">y</a>'
                                     '<a href="/a.html">z</a><a href="/c.html">w</a>')
    assert broken_links(tmp_path) == ["a.html -> b.html", "a.html -> a.html#nope (no such anchor)",
                                      "a.html -> /c.html"]
    # A lesson's download sits beside its page: a link into one of its sections is broken.
    (tmp_path / "a.html").write_text('<a href="n.ipynb">x</a><a href="n.ipynb#why">y</a>')
    (tmp_path / "n.ipynb").write_text("{}")
    assert broken_links(tmp_path) == ["a.html -> n.ipynb#why (an anchor into a file)"]
    # A path that climbs out of the site finds the repository's files, not the site's pages.
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "a.html").write_text('<a href="../n.ipynb">x</a>')
    assert broken_links(tmp_path / "site") == ["a.html -> ../n.ipynb (outside the site)"]


def test_a_lessons_file_links_become_site_pages():
    """Lessons link files as JupyterLab sees them; the site rewrites them to its pages."""
    sys.path.insert(0, str(REPO / "tools"))
    import site_hooks

    def on_site(href):
        return site_hooks._REPO_LINK.sub(site_hooks.site_link, f'href="{href}"')[6:-1]

    assert on_site("../docs/onboarding-exercises.md#exercise-61") == "../onboarding-exercises.html#exercise-61"
    assert on_site("06_performance.ipynb#3-the-bubble") == "06_performance.html#3-the-bubble"
    assert on_site("../exercises/README.md") == "../exercises/index.html"
    assert on_site("../labs/lab01_ddp.py") == "../labs/lab01_ddp.html"
    assert on_site("https://example.org/a.md") == "https://example.org/a.md"


def test_lab_page_includes_the_real_source(site):
    page = (site / "labs" / "lab01_ddp.html").read_text()
    # Highlighting splits code into spans, so look for identifiers, not whole lines.
    for name in ("apply_ddp", "init_process_group", "set_epoch", "no_sync", "attempt_store"):
        assert name in page, name
    assert "8&lt;--" not in page  # the include directive was replaced by the file
    assert "What changed since" not in page  # lab01 is the first lab: nothing to diff
    kit = (site / "labs" / "labkit.html").read_text()  # the kit page shows every module's source
    for name in ("PreemptionWatch", "SyntheticSequences", "def init_mesh", "save_dcp_atomically"):
        assert name.split()[-1] in kit, name
    assert "8&lt;--" not in kit
    lab02 = (site / "labs" / "lab02_fsdp.html").read_text()  # lab01 and lab02: both on the kit
    assert "What changed since" in lab02 and "fully_shard" in lab02


def numbered_items(markdown):
    """Top-level "N. " lines outside code fences: what the page's ordered lists should hold."""
    count, in_fence = 0, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line[:1].isdigit() and line.split(" ", 1)[0].rstrip(".").isdigit() \
                and line.split(" ", 1)[0].endswith("."):
            count += 1
    return count


class TopLevelListItems(html.parser.HTMLParser):
    """Counts <li> directly inside an <ol> that is not itself inside a list item."""

    def __init__(self):
        super().__init__()
        self.stack, self.count = [], 0

    def handle_starttag(self, tag, attrs):
        if tag in ("ol", "ul", "li"):
            if tag == "li" and self.stack[-1:] == ["ol"] and "li" not in self.stack:
                self.count += 1
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in ("ol", "ul", "li") and tag in self.stack:
            while self.stack.pop() != tag:
                pass


def rendered_numbered_items(html_text):
    parser = TopLevelListItems()
    parser.feed(html_text)
    return parser.count


def test_numbered_lists_render_as_one_list_item_per_number(site):
    """Python-Markdown needs 4 spaces to keep a code block inside a list item: with 3, the list
    breaks there and the items after it run into one paragraph (it happened to Quick triage);
    after an item with a code block, the next number also needs a blank line before it."""
    broken = []
    pages = [(source, site / "runbooks" / source.with_suffix(".html").name)
             for source in sorted((REPO / "runbooks").glob("*.md"))]
    pages += [(source, site / source.relative_to(REPO / "docs").with_suffix(".html"))
              for source in sorted((REPO / "docs").rglob("*.md"))]
    for source, built in pages:
        expected = numbered_items(source.read_text())
        got = rendered_numbered_items(built.read_text())
        if got != expected:
            broken.append(f"{source.name}: {expected} numbered lines, {got} list items")
    assert broken == []


def accidental_headings(markdown):
    """Prose lines, or list items, that start with "#<digit>" (an issue number wrapped onto a
    new line, or opening a bullet): Markdown renders each as a heading."""
    prose = re.sub(r"^ *```.*?^ *```", "", markdown, flags=re.S | re.M)
    return re.findall(r"^(?: *(?:[-*+]|\d+\.) +)?#\d.*$", prose, re.M)


def test_no_issue_number_wraps_into_a_heading():
    pages = [*sorted((REPO / "runbooks").glob("*.md")), *sorted((REPO / "docs").rglob("*.md")),
             *sorted((REPO / "i18n").rglob("*.md"))]
    found = {str(p.relative_to(REPO)): accidental_headings(p.read_text()) for p in pages}
    assert {name: lines for name, lines in found.items() if lines} == {}
    assert accidental_headings("see PR\n#142260, merged\n```\n#0 frame\n```\n") == [
        "#142260, merged"]
    assert accidental_headings("- #8 FSDP1 has no DTensor\n- *#9* fine\n") == [
        "- #8 FSDP1 has no DTensor"]


def test_list_check_catches_a_list_broken_by_a_code_block():
    markdown = "1. one\n\n   ```\n   code\n   ```\n\n2. two\n3. three\n"
    assert numbered_items(markdown) == 3
    broken_html = "<ol><li>one</li></ol><pre>code</pre><p>2. two 3. three</p>"
    assert rendered_numbered_items(broken_html) == 1
    nested = "<ol><li>a<ol><li>x</li></ol></li><li>b</li></ol>"
    assert rendered_numbered_items(nested) == 2


def test_the_chinese_glossary_shows_every_term_it_enforces(site):
    import yaml

    page = (site / "zh" / "reference" / "glossary.html").read_text()
    terms = yaml.safe_load((REPO / "i18n" / "zh" / "terms.yml").read_text())
    assert 'id="terms"' in page
    missing = [t["en"] for t in terms
               if f"<td>{html.escape(t['en'], quote=False)}</td>" not in page]
    assert missing == []


CHINESE_SEARCHES = [  # (a query as a Chinese reader types it, the page that must come first)
    ("显存不足", "runbooks/oom-reading-the-error"),  # CUDA out of memory
    ("流水线气泡", "lessons/04_pipeline"),  # pipeline bubble
    ("死锁", "runbooks/collective-timeout"),  # a hang, as Chinese posts usually call it
    ("梯度累积", "reference/wrong-advice"),  # the gradient accumulation myth
]


@pytest.mark.parametrize("query, expected", CHINESE_SEARCHES)
def test_chinese_search_finds_the_chinese_page_first(browser, served_site, query, expected):
    """The Chinese edition's search (jieba segments its index at build time) ranks the right
    Chinese page first."""
    page = search(browser, f"{served_site}/zh", query)
    first = page.locator(".md-search-result__item > a").first
    first.wait_for(state="visible", timeout=15000)
    href = first.get_attribute("href")
    assert f"/zh/{expected}.html" in href, href


def test_the_language_selector_leads_to_the_chinese_page(browser, served_site):
    page = browser.new_page()
    page.goto(f"{served_site}/lessons/01_ddp.html")
    page.locator(".md-select button").first.hover()
    page.locator("a.md-select__link[hreflang='zh']").click()
    page.wait_for_url("**/zh/lessons/01_ddp.html")
    assert "数据并行" in page.inner_text("body") or "为什么" in page.inner_text("body")
    assert "done | lab01_ddp | gloo x2" in page.inner_text("body")


# From file:// material's search cannot load its index (its offline plugin would fetch a
# script from unpkg.com); everything else must work. The README says to serve the folder
# (python -m http.server) for search.
FILE_URL_SEARCH_ERROR = re.compile(r"^Invalid script: file://.*/search/search_index\.js$")


def test_the_chinese_site_works_from_file_urls(browser, site):
    """Opened as a folder of files, with no server: the page, its plots, the selector."""
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto((site / "zh" / "lessons" / "01_ddp.html").as_uri())
    plot = page.locator("img[src^='data:image/png']").first
    plot.wait_for(state="visible", timeout=15000)
    assert plot.evaluate("img => img.naturalWidth") > 100
    english = page.locator("a.md-select__link[hreflang='en']").get_attribute("href")
    page.goto((site / "zh" / "lessons" / english).resolve().as_uri())
    assert "done | lab01_ddp | gloo x2" in page.inner_text("body")
    assert "Why" in page.inner_text("h2")  # the English lesson
    assert [e for e in errors if not FILE_URL_SEARCH_ERROR.match(e)] == []


LESSON_STEMS = sorted(p.stem for p in (REPO / "lessons").glob("[0-9][0-9]_*.py"))


def imported_modules(notebook):
    """The top-level module names a notebook's code cells import."""
    import ast

    names = set()
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("edition", ["en", "zh"])
def test_every_lesson_page_offers_a_zip_that_holds_what_it_imports(site, edition):
    """The zip holds the edition's executed notebook, and every course module it imports
    (from lessons/ or labs/) where the lesson looks for it."""
    root = site if edition == "en" else site / "zh"
    for stem in LESSON_STEMS:
        page = (root / "lessons" / f"{stem}.html").read_text()
        assert f'href="../downloads/{stem}.zip"' in page, stem
        with zipfile.ZipFile(root / "downloads" / f"{stem}.zip") as archive:
            names = set(archive.namelist())
            notebook = json.loads(archive.read(f"{stem}/lessons/{stem}.ipynb"))
        course_modules = {name: folder for name in imported_modules(notebook)
                          for folder in ("lessons", "labs")
                          if (REPO / folder / f"{name}.py").exists()
                          or (REPO / folder / name / "__init__.py").exists()}
        assert course_modules, stem  # every lesson imports some: the check is not empty
        assert f"{stem}/labs/labkit/__init__.py" in names  # what the labs import
        for name, folder in course_modules.items():
            assert ({f"{stem}/{folder}/{name}.py", f"{stem}/{folder}/{name}/__init__.py"}
                    & names), (stem, name)
        prose = "".join("".join(c["source"]) for c in notebook["cells"]
                        if c["cell_type"] == "markdown")
        assert bool(re.search(r"[\u4e00-\u9fff]", prose)) == (edition == "zh"), stem


def test_a_downloaded_lesson_runs_from_an_empty_folder(site, tmp_path, monkeypatch):
    """The README's way to take a lesson away: the zip, unpacked outside the checkout, runs
    top to bottom with nothing from it (no COURSE_ROOT: the lesson finds labs/ beside it).
    The quickest lesson runs here; the test above checks every zip's contents."""
    import nbformat
    from nbclient import NotebookClient

    stem = "08_expert_parallel"
    with zipfile.ZipFile(site / "downloads" / f"{stem}.zip") as archive:
        archive.extractall(tmp_path)
    monkeypatch.delenv("COURSE_ROOT", raising=False)
    lessons = tmp_path / stem / "lessons"
    notebook = nbformat.read(lessons / f"{stem}.ipynb", as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []  # so that what is checked below is this run's
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(lessons)}}).execute()
    errors = [out for cell in notebook.cells if cell.cell_type == "code"
              for out in cell.outputs if out.output_type == "error"]
    assert errors == []
    ran = [cell for cell in notebook.cells if cell.cell_type == "code" and cell.outputs]
    assert len(ran) >= 3  # it did run, and printed


def test_lesson_page_shows_executed_outputs(site):
    page = (site / "lessons" / "01_ddp.html").read_text()
    assert "data:image/png;base64" in page  # the loss-curve plot
    assert "parity" in page and "Traceback" not in page


def chromium_path():
    return os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium")


@pytest.fixture(scope="module")
def served_site(site):
    """The README's `python -m http.server -d site`, on a free port of 127.0.0.1."""
    from launcher import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "-d", str(site), "--bind",
                               "127.0.0.1", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"python -m http.server did not serve {url} within 60 s")
            time.sleep(0.2)
    yield url
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    if not chromium_path():
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser checks, but no chromium was found")
        pytest.skip("no chromium: `make test` installs it on Debian/Ubuntu, or set COURSE_CHROMIUM")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-sync"])
        yield browser
        browser.close()


def test_browser_renders_home_and_navigates_to_a_lesson(browser, served_site):
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{served_site}/index.html")
    assert "Distributed PyTorch, Hands-On" in page.title()
    nav = page.locator("nav.md-nav--primary").inner_text()
    for section in ("Lessons", "Labs", "Runbooks"):
        assert section in nav
    page.goto(f"{served_site}/lessons/01_ddp.html")
    plot = page.locator("img[src^='data:image/png']").first
    plot.wait_for(state="visible", timeout=15000)
    assert plot.evaluate("img => img.naturalWidth") > 100  # a real, decoded image
    assert "done | lab01_ddp | gloo x2" in page.inner_text("body")
    assert errors == []


def search(browser, served_site, query):
    """Type `query` into the site's search box, as a reader does; return the page."""
    page = browser.new_page()
    page.goto(f"{served_site}/index.html")
    page.locator("label.md-search__icon, .md-search__input").first.click()
    page.locator("input.md-search__input").fill(query)
    return page


def test_browser_search_finds_a_lab(browser, served_site):
    page = search(browser, served_site, "no_sync")
    result = page.locator(".md-search-result__item").first
    result.wait_for(state="visible", timeout=15000)
    assert page.locator(".md-search-result__item").count() >= 1


SCREENSHOTS = REPO / "build" / "screenshots"  # kept by CI as artifacts


class WatchedTab:
    """A browser tab that records the requests it makes and the errors it reports."""

    def __init__(self, browser):
        self.page = browser.new_page()
        self.requests, self.errors = [], []
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("console", lambda message: self.errors.append(message.text)
                     if message.type == "error" else None)

    def start(self, url):
        self.requests.clear()
        self.errors.clear()
        self.page.goto(url, wait_until="commit")

    def problems(self, path, base):
        """Once the page has gone quiet: its errors, and every request that left `base`."""
        self.page.wait_for_load_state("networkidle")
        return ([f"{path}: {error}" for error in self.errors]
                + [f"{path}: request to {url}" for url in self.requests
                   if not url.startswith((base, "data:", "blob:", "about:"))])


def test_every_page_loads_clean_and_offline(browser, served_site, site):
    """No JavaScript error, no console error, and no request leaving localhost, on any page.
    Four tabs load at once: most of a page's time is the half second of network quiet that
    `networkidle` waits for, and the tabs wait it out together."""
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    assert len(pages) >= 30, pages
    tabs = [WatchedTab(browser) for _ in range(4)]
    problems = []
    for first in range(0, len(pages), len(tabs)):
        batch = list(zip(tabs, pages[first:first + len(tabs)]))
        for tab, path in batch:
            tab.start(f"{served_site}/{path}")
        for tab, path in batch:
            problems += tab.problems(path, served_site)
    assert problems == [], "\n".join(problems[:40])
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page = tabs[0].page
    for name, path in (("home", "index.html"), ("lesson01", "lessons/01_ddp.html")):
        page.goto(f"{served_site}/{path}", wait_until="networkidle")
        page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=False)
        assert (SCREENSHOTS / f"{name}.png").stat().st_size > 10_000


def test_a_watched_tab_reports_errors_and_outside_requests(browser, tmp_path):
    """The check above can fail: a page that throws and fetches from outside is reported."""
    bad = tmp_path / "bad.html"
    bad.write_text('<img src="http://example.invalid/x.png">'
                   '<script>throw new Error("deliberate")</script>')
    tab = WatchedTab(browser)
    tab.start(bad.as_uri())
    problems = tab.problems("bad.html", tmp_path.as_uri())
    assert any("deliberate" in p for p in problems), problems
    assert any("request to http://example.invalid/x.png" in p for p in problems), problems


def test_browser_search_finds_a_runbook_by_its_error_string(browser, served_site):
    page = search(browser, served_site, "terminate called without an active exception")
    result = page.locator(".md-search-result__item a[href*='runbooks/exit-hang']").first
    result.wait_for(state="attached", timeout=15000)


def paste_every_line(browser, url):
    """Each line of tests/pasted_log_lines.py pasted into the search box of the edition at
    `url`, as a reader does (the whole line in one input event, then the key release the
    theme listens for): [(line, page expected, first result's href or None, the query the
    box ends up with)]."""
    page = browser.new_page()
    page.goto(f"{url}/index.html")
    page.locator("label.md-search__icon, .md-search__input").first.click()
    box, meta = page.locator("input.md-search__input"), page.locator(".md-search-result__meta")
    box.fill("timeout")  # the worker builds its index on the first query: wait for it
    page.locator(".md-search-result__item").first.wait_for(state="attached", timeout=30000)
    rows = []
    for line, expected, _ in PASTED_LOG_LINES:
        box.fill("")
        page.wait_for_function("() => !document.querySelector('.md-search-result__item')")
        cleared = meta.inner_text()
        box.fill(line)
        page.keyboard.press("End")
        page.wait_for_function("t => document.querySelector('.md-search-result__meta')"
                               ".innerText !== t", arg=cleared, timeout=15000)
        page.wait_for_timeout(200)  # the worker answers per keystroke: let the last answer land
        first = page.locator(".md-search-result__item > a").first
        href = first.get_attribute("href") if first.count() else None
        rows.append((line, expected, href, box.input_value()))
    page.close()
    return rows


@pytest.mark.parametrize("edition", ["en", "zh"])
def test_a_pasted_log_line_finds_the_page_that_explains_it_first(browser, served_site, edition):
    """Both editions take the same English lines (logs are in English whatever the reader's
    language), and every line must find its page first: none is excused."""
    rows = paste_every_line(browser, served_site if edition == "en" else f"{served_site}/zh")
    first = [row for row in rows if row[2] and f"runbooks/{row[1]}.html" in row[2]]
    print(f"{edition}: {len(first)} of {len(rows)} pasted lines ({len(first) / len(rows):.0%}) "
          "find the page that explains them first")
    misses = [f"{expected}: {line!r} -> {href} (query {query!r})"
              for line, expected, href, query in rows if (line, expected, href, query) not in first]
    assert misses == []
    noisy = [query for _, _, _, query in rows if re.search(r"\d\d:\d\d|pid \d|\.cpp:\d", query)]
    assert noisy == []  # the timestamps, pids and file:line prefixes are gone


def test_the_pasted_lines_are_many_and_varied():
    assert len(PASTED_LOG_LINES) >= 40
    assert len({page for _, page, _ in PASTED_LOG_LINES}) >= 15
    assert {source for _, _, source in PASTED_LOG_LINES} == {"drill", "reported"}
    for _, page, _ in PASTED_LOG_LINES:
        assert (REPO / "runbooks" / f"{page}.md").exists(), page


def test_a_short_typed_query_is_left_alone(browser, served_site):
    page = search(browser, served_site, "no_sync 2 ranks")
    page.keyboard.press("End")
    assert page.locator("input.md-search__input").input_value() == "no_sync 2 ranks"
    page.close()


def test_a_message_typed_key_by_key_is_left_alone(browser, served_site):
    """Only a whole line arriving at once is rewritten: typing is never interrupted."""
    page = search(browser, served_site, "")
    page.keyboard.type("Connection reset by peer 12")
    assert page.locator("input.md-search__input").input_value() == "Connection reset by peer 12"
    page.close()


def test_search_settings_name_pages_that_exist(site):
    """A renamed page would silently lose its boost (or the index its exclusion)."""
    import site_hooks  # tools/site_hooks.py

    for src_uri, settings in site_hooks.SEARCH_SETTINGS.items():
        assert (REPO / src_uri).exists(), src_uri
    index = json.loads((site / "search" / "search_index.json").read_text())
    boosts = {doc["location"].split("#")[0]: doc["boost"] for doc in index["docs"]
              if "boost" in doc and not doc["location"].startswith("labs/")}
    assert boosts == {"runbooks/index.html": 0.3, "runbooks/oom-reading-the-error.html": 4}
    assert not any(doc["location"].startswith("runbooks/errors.html") for doc in index["docs"])

def test_the_runbook_nav_follows_the_index_and_misses_no_page():
    import site_hooks  # tools/site_hooks.py

    groups = site_hooks.runbook_nav_groups()
    titles = [next(iter(group)) for group in groups]
    assert "Not in the index yet" not in titles, groups[-1]
    assert titles[:2] == ["Launching and start-up", "Hangs and timeouts"], titles
    pages = [page for group in groups for page in next(iter(group.values()))]
    assert sorted(pages) == sorted(f"runbooks/{p.name}" for p in site_hooks.runbook_paths())

def test_phone_sized_viewport_navigates_from_the_menu(browser, served_site):
    page = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True,
                            has_touch=True)
    page.goto(f"{served_site}/index.html")
    sidebar = page.locator("nav.md-nav--primary")
    page.locator("label.md-header__button[for='__drawer']").click()  # the hamburger
    sidebar.locator("label.md-nav__link", has_text="Runbooks").first.click()  # its panel
    sidebar.locator("label.md-nav__link", has_text="Hangs and timeouts").first.click()  # group
    sidebar.locator("a[href$='runbooks/exit-hang.html']").first.click()
    page.wait_for_url("**/runbooks/exit-hang.html")
    assert "terminate called without an active exception" in page.inner_text("article")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "phone-runbook.png"))


def test_verified_stamps_come_from_recorded_runs(site):
    """Lab pages: the stamp tools/verified.py computes from the recorded launches (written by
    run_lab in these very tests); lesson pages: the facts stored with the executed notebook."""
    import html as html_lib

    sys.path.insert(0, str(REPO / "tools"))
    import verified

    for lab in sorted(p.stem for p in (REPO / "labs").glob("lab0*.py")):
        page = html_lib.unescape((site / "labs" / f"{lab}.html").read_text())
        stamp = verified.lab_stamp(lab)
        if os.environ.get("CI"):
            assert stamp is not None, f"the test run recorded no successful {lab} launch"
        expected = stamp or "No run of this lab was recorded"
        assert expected in page, lab
    for notebook in sorted((REPO / "build" / "executed" / "lessons").glob("*.ipynb")):
        facts = json.loads(notebook.read_text())["metadata"]["course"].get("verified")
        page = html_lib.unescape((site / "lessons" / f"{notebook.stem}.html").read_text())
        if os.environ.get("CI"):  # the lessons ran earlier in this session, recording it
            assert facts and facts["torch"] == __import__("torch").__version__, notebook.stem
        expected = verified.lesson_stamp(facts) if facts else "No record of the run that executed it."
        assert expected in page, notebook.stem


def test_decision_guide_figures_are_the_estimators(site):
    """Every table cell of the generated guide, recomputed here from labs/memory_estimator.py."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("memory_estimator",
                                                  REPO / "labs" / "memory_estimator.py")
    est = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(est)
    page = (site / "reference" / "which-parallelism.html").read_text()
    rows = re.findall(r"<tr>\s*<td>(\d+)B</td>\s*<td>(\d+)</td>(.*?)</tr>", page, re.S)
    assert len(rows) == 12, rows
    for billions, gpus, cells in rows:
        shown = re.findall(r"<td>([\d,.]+) GB \((?:fits|<strong>too big</strong>)\)</td>", cells)
        for strategy, value in zip(("ddp", "zero1", "zero2", "zero3"), shown, strict=True):
            total = est.estimate_per_rank(int(billions) * 10**9, int(gpus), strategy,
                                          param_bytes=2, grad_bytes=2, master_weights=True)
            assert abs(float(value.replace(",", "")) - total.total_bytes / 1e9) <= 0.05 + 1e-9, \
                (billions, gpus, strategy, value)


def test_decision_guide_throughput_is_perf_models_with_its_stated_assumptions(site):
    """The throughput table: 12 rows; 'does not fit' exactly where the memory table says too
    big; and one cell worked by hand from the stated assumptions (8B on one node of 8)."""
    import html as html_lib

    page = html_lib.unescape((site / "reference" / "which-parallelism.html").read_text())
    rows = re.findall(r"<tr>\s*<td>(\d+)B \((\d+) x (\d+)\)</td>\s*<td>(\d+)</td>\s*"
                      r"<td>([\d.]+) s</td>\s*<td>(.*?)</td>\s*<td>(.*?)</td>\s*</tr>", page, re.S)
    assert len(rows) == 12, rows
    memory = dict(((b, g), cells) for b, g, cells in re.findall(
        r"<tr>\s*<td>(\d+)B</td>\s*<td>(\d+)</td>(.*?)</tr>", page, re.S))
    for billions, layers, dim, gpus, compute_s, ddp, fsdp in rows:
        mem = re.findall(r"<td>[\d,.]+ GB \((fits|<strong>too big</strong>)\)</td>",
                         memory[(billions, gpus)])
        assert (ddp == "does not fit") == (mem[0] != "fits"), (billions, gpus)
        assert (fsdp == "does not fit") == (mem[3] != "fits"), (billions, gpus)
    row = next(r for r in rows if r[0] == "8" and r[3] == "8")
    flop_per_token = 6 * 8e9 + 12 * 32 * 4096 * 8192
    compute = flop_per_token * 16384 / 989e12          # 2 x 8192 tokens at the bf16 peak
    comm = 8e9 * (2 * 2 + 4) * 7 / 8 / 450e9           # bf16 gathers twice, fp32 reduce, NVLink
    assert float(row[4]) == pytest.approx(compute, abs=0.005)
    fast, slow, shown_comm = re.fullmatch(r"([\d,]+) to ([\d,]+) \(comm ([\d.]+) s\)",
                                          row[6]).groups()
    assert int(fast.replace(",", "")) == pytest.approx(16384 / max(compute, comm), abs=1)
    assert int(slow.replace(",", "")) == pytest.approx(16384 / (compute + comm), abs=1)
    assert float(shown_comm) == pytest.approx(comm, abs=0.005)


def test_lab_pages_show_the_use_it_in_your_project_guide(site):
    """The docstring block (format checked by tests/test_lab_guides.py) becomes a section with
    its runbook paths turned into working links (the link checker above covers them)."""
    for lab in sorted(p.stem for p in (REPO / "labs").glob("lab0*.py")):
        page = (site / "labs" / f"{lab}.html").read_text()
        section = page[page.index('id="use-it-in-your-project"'):page.index('id="source"')]
        for label in ("Replace:", "Keep:", "Pitfalls:"):
            assert f"<strong>{label}</strong>" in section, (lab, label)
        assert 'href="../runbooks/' in section, lab
        assert "Use it in your project:" not in page.split('id="source"')[0], lab  # not twice


def check_lab_and_kit_downloads(site, lab):
    """A lab on the kit offers itself and a zip of itself with labs/labkit/, byte for byte, and
    its page links every kit module it imports from to that module's section of the kit page."""
    import html as html_lib
    import zipfile

    assert (site / "downloads" / lab.name).read_text() == lab.read_text()
    with zipfile.ZipFile(site / "downloads" / f"{lab.stem}.zip") as archive:
        names = sorted(archive.namelist())
        kit = sorted((REPO / "labs" / "labkit").glob("*.py"))
        assert names == sorted([f"{lab.stem}/{lab.name}",
                                *(f"{lab.stem}/labkit/{p.name}" for p in kit)])
        for module in kit:
            assert archive.read(f"{lab.stem}/labkit/{module.name}") == module.read_bytes()
    page = html_lib.unescape((site / "labs" / f"{lab.stem}.html").read_text())
    assert f'href="../downloads/{lab.stem}.zip"' in page
    assert f"{len(lab.read_text().splitlines())} lines" in page
    modules = set(re.findall(r"^from labkit(?:\.(\w+) import| import (\w+))", lab.read_text(),
                             re.M))
    modules = {dotted or whole for dotted, whole in modules}
    assert modules and all(f'href="labkit.html#{m}"' in page for m in modules), modules
    kit_page = (site / "labs" / "labkit.html").read_text()
    assert all(f'id="{m}"' in kit_page for m in modules), modules


def test_lab_pages_offer_the_lab_and_the_kit(site):
    """The lab and a zip of it with the kit, linked from the page with their line counts; the
    page shows the lab's own --plan output and says whether a GPU run is on record."""
    import html as html_lib

    sys.path.insert(0, str(REPO / "tools"))
    import verified

    for lab in sorted((REPO / "labs").glob("lab0*.py")):
        page = html_lib.unescape((site / "labs" / f"{lab.stem}.html").read_text())
        check_lab_and_kit_downloads(site, lab)
        assert f"plan | {lab.stem} | 8 x H100-80GB | --model 8b: 8.03B params" in page
        gpu = verified.gpu_stamp(lab.stem)
        assert (gpu or "Not yet verified on a GPU") in page, lab.stem
