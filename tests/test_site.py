"""The published site: builds with --strict, has no broken internal links or anchors, and renders
in a real headless browser with the lessons' executed outputs and plots.

Runs after the lessons (testpaths order), so the build reuses the notebooks nbval just executed.
"""

import functools
import html.parser
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


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
            if not target.exists():
                broken.append(f"{page.relative_to(site_dir)} -> {href}")
            elif url.fragment and target.suffix == ".html":
                if url.fragment not in pages.get(target, parse(target)).ids:
                    broken.append(f"{page.relative_to(site_dir)} -> {href} (no such anchor)")
    return broken


def test_every_section_is_built(site):
    assert (site / "index.html").exists()
    assert (site / "lessons" / "01_ddp.html").exists()
    assert (site / "labs" / "lab01_ddp.html").exists()
    assert (site / "runbooks" / "index.html").exists()


def test_no_broken_internal_links_or_anchors(site):
    assert broken_links(site) == []


def test_link_checker_catches_a_broken_link(tmp_path):
    (tmp_path / "a.html").write_text('<a href="b.html">x</a><a href="a.html#nope">y</a>'
                                     '<a href="/a.html">z</a><a href="/c.html">w</a>')
    assert broken_links(tmp_path) == ["a.html -> b.html", "a.html -> a.html#nope (no such anchor)",
                                      "a.html -> /c.html"]


def test_lab_page_includes_the_real_source(site):
    page = (site / "labs" / "lab01_ddp.html").read_text()
    # Highlighting splits code into spans, so look for identifiers, not whole lines.
    for name in ("apply_ddp", "SyntheticSequences", "attempt_store", "PreemptionWatch"):
        assert name in page, name
    assert "8&lt;--" not in page  # the include directive was replaced by the file
    assert "What changed since" not in page  # lab01 is the first lab: nothing to diff
    lab02 = (site / "labs" / "lab02_fsdp.html").read_text()
    assert "What changed since" in lab02 and "fully_shard" in lab02


def test_lesson_page_shows_executed_outputs(site):
    page = (site / "lessons" / "01_ddp.html").read_text()
    assert "data:image/png;base64" in page  # the loss-curve plot
    assert "parity" in page and "Traceback" not in page


def chromium_path():
    return os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium")


@pytest.fixture(scope="module")
def served_site(site):
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


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
    page.screenshot(path=str(REPO / "build" / "lesson01.png"), full_page=False)
    assert errors == []


def test_browser_search_finds_a_lab(browser, served_site):
    page = browser.new_page()
    page.goto(f"{served_site}/index.html")
    page.locator("label.md-search__icon, .md-search__input").first.click()
    page.locator("input.md-search__input").fill("no_sync")
    result = page.locator(".md-search-result__item").first
    result.wait_for(state="visible", timeout=15000)
    assert page.locator(".md-search-result__item").count() >= 1
