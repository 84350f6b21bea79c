"""MkDocs hooks: assemble the site from the repo as it is, so nothing is pasted by hand.

- lessons/NN_*.py  -> lessons/NN_*.ipynb pages, from the executed notebooks (tools/lessons.py;
  a lesson whose cached execution is stale or missing is executed now);
- labs/labNN_*.py  -> labs/labNN_*.md pages: docstring, run command, source included from the
  file, and a diff against the previous lab generated here;
- runbooks/*.md    -> runbooks/ pages, as they are;
- the nav is built from what exists, in course order.
"""

import ast
import difflib
import json
import re
import sys
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lessons as lesson_tools  # noqa: E402  (tools/lessons.py)
import decision_guide  # noqa: E402  (tools/decision_guide.py)
import error_index  # noqa: E402  (tools/error_index.py)
import lean  # noqa: E402  (tools/lean.py)
import verified  # noqa: E402  (tools/verified.py)

ROOT = Path(__file__).resolve().parents[1]



def runbook_paths():
    return sorted(p for p in (ROOT / "runbooks").glob("*.md") if p.name != "index.md")


def docstring(path):
    """The module docstring as Python sees it (escapes such as a trailing \\ resolved)."""
    return (ast.get_docstring(ast.parse(path.read_text())) or "").strip()


_GUIDE = re.compile(r"^Use it in your project:\n((?:  .*(?:\n|$))+)", re.M)


def project_guide(doc):
    """Split the docstring's "Use it in your project:" block off as markdown (labels in bold,
    runbook paths as links); return (markdown or None, the rest of the docstring)."""
    match = _GUIDE.search(doc)
    if not match:
        return None, doc
    lines = [line[2:] for line in match.group(1).rstrip().splitlines()]
    guide = re.sub(r"^- (Replace|Keep|Pitfalls):", r"- **\1:**", "\n".join(lines), flags=re.M)
    guide = re.sub(r"`?runbooks/([\w-]+)\.md`?", r"[\1](../runbooks/\1.md)", guide)
    return guide, doc[:match.start()] + doc[match.end():]


PLAN_EXAMPLE = ["--plan", "--model", "8b", "--nproc", "8", "--gpu", "H100-80GB"]


def plan_example(lab):
    """The lab's own --plan output for 8b on 8 x H100-80GB, run at build time (no GPU needed)."""
    import subprocess

    extra = ["--microbatches", "8"] if "pipeline" in lab.stem else []
    cmd = [sys.executable, str(lab), *PLAN_EXAMPLE, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    return f"python labs/{lab.name} {' '.join(PLAN_EXAMPLE + extra)}", out.strip()


def downloads(lab):
    """Markdown for the two files a reader can take: the full lab and its lean copy."""
    full, slim = lab.read_text(), lean.lean_source(lab.read_text(), lab.stem)
    return ["## Download", "",
            f"- [`{lab.name}`](../downloads/{lab.name}): the full lab, "
            f"{len(full.splitlines())} lines, with its parity reference, probes and fault drills.",
            f"- [`{lab.name}`, lean](../downloads/lean/{lab.name}): the copy a project keeps, "
            f"{len(slim.splitlines())} lines: the same training (its losses equal the full "
            "lab's bit for bit), without the teaching and drill code. `make lean` writes it "
            "to `build/lean/`.", ""]


def lab_page(lab, previous):
    guide, doc = project_guide(docstring(lab))
    title, _, rest = doc.partition("\n")
    stamp, gpu_stamp = verified.lab_stamp(lab.stem), verified.gpu_stamp(lab.stem)
    plan_cmd, plan_out = plan_example(lab)
    lines = [f"# {title}", "",
             f"Source: `labs/{lab.name}` (one self-contained file: copy it "
             "anywhere with torch installed and run it).", "",
             f"!!! success \"Verified\"\n    {stamp}" if stamp
             else "!!! warning \"Not verified in this build\"\n    No run of this lab was recorded "
                  "(`make test` and `make course` record them).", "",
             f"!!! success \"Verified on GPU\"\n    {gpu_stamp}" if gpu_stamp
             else "!!! note \"Not yet verified on a GPU\"\n    No `make gpu-check` run is "
                  "recorded (`verified/gpu-check.jsonl`). The CUDA path is tested on CPU with "
                  "faked devices (`tests/test_gpu_defaults.py`); nothing here was measured on "
                  "a GPU.", "",
             *downloads(lab),
             "```text", rest.strip(), "```", "",
             "## Run it", "", "```bash", f"torchrun --standalone --nproc-per-node 2 labs/{lab.name}"
             " --check-parity", "```", ""]
    if guide:
        lines += ["## Use it in your project", "", guide, ""]
    lines += ["## Plan a big run", "", "What the lab would do on hardware this machine does "
              "not have; it starts no process group. Run at build time:", "", "```bash",
              plan_cmd, "```", "", "```text", plan_out, "```", ""]
    log = ROOT / "build" / "course" / f"{lab.stem}.log"
    if log.exists():
        output = [line for line in log.read_text().splitlines() if not line.startswith("W")]
        lines += ["## Output of the last `make course` run", "", "```text", *output[-12:],
                  "```", ""]
    lines += ["## Source", "", "```python", f'--8<-- "labs/{lab.name}"', "```", ""]
    if previous is not None:
        diff = difflib.unified_diff(previous.read_text().splitlines(),
                                    lab.read_text().splitlines(),
                                    f"labs/{previous.name}", f"labs/{lab.name}", lineterm="")
        lines += [f"## What changed since `{previous.name}`", "",
                  "Generated at build time; the shared regions (cli, setup, mesh, model, data, "
                  "metrics, plan, faults, schedule, loop, main) are identical, so the diff is "
                  "the new technique.", "",
                  "```diff", *diff,
                  "```", ""]
    return "\n".join(lines)


def labs_index():
    rows = ["| lab | what it teaches | command |", "|---|---|---|"]
    for lab in lesson_tools.lab_paths():
        title = docstring(lab).splitlines()[0]
        rows.append(f"| [{lab.stem}]({lab.stem}.md) | {title} | "
                    f"`torchrun --standalone --nproc-per-node 2 labs/{lab.name}` |")
    return "# Labs\n\nOne torchrun script per lesson; each runs on CPU (gloo) and on GPUs " \
           "(NCCL) unchanged.\n\n" + "\n".join(rows) + "\n"


def torchrun_flags_page():
    """The flag table straight from the parser torchrun uses, so defaults are never retyped."""
    import torch
    from torch.distributed.run import get_args_parser

    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in get_args_parser()._actions:
        if not action.option_strings or "--help" in action.option_strings:
            continue
        flag = " ".join(f"`{o}`" for o in action.option_strings if "_" not in o)
        helptext = " ".join((action.help or "").split()).replace("|", "\\|")
        rows.append(f"| {flag} | `{action.default!r}` | {helptext} |")
    return (f"# torchrun flags (torch {torch.__version__})\n\nGenerated at build time from "
            "`torch.distributed.run.get_args_parser()`, the parser torchrun itself uses. The "
            "defaults shown are the parser's; [launching](launching.md) explains the ones "
            "that are resolved later.\n\n" + "\n".join(rows) + "\n")


def error_messages_script():
    """The error index's stable substrings, longest first, for the search box: a pasted log
    line is searched for the known message it contains (docs/javascripts/search-log-line.js)."""
    messages = sorted({e.message for e in error_index.parse_index()}, key=len, reverse=True)
    return f"window.courseErrorMessages = {json.dumps(messages, indent=0)};\n"


def add_generated(files, config, src_uri, content):
    files.append(File.generated(config, src_uri, content=content))


@event_priority(100)  # before mkdocs-jupyter turns .ipynb files into pages
def on_files(files, config):
    # Real File objects (not File.generated): mkdocs-jupyter 0.26 loses the source path of
    # generated files when it wraps them.
    for lesson in lesson_tools.lesson_paths():
        lesson_tools.ensure_executed(lesson)
        files.append(File(f"lessons/{lesson.stem}.ipynb", str(lesson_tools.EXECUTED_ROOT),
                          config.site_dir, config.use_directory_urls))
    previous = None
    for lab in lesson_tools.lab_paths():
        add_generated(files, config, f"labs/{lab.stem}.md", lab_page(lab, previous))
        add_generated(files, config, f"downloads/{lab.name}", lab.read_text())
        add_generated(files, config, f"downloads/lean/{lab.name}",
                      lean.lean_source(lab.read_text(), lab.stem))
        previous = lab
    add_generated(files, config, "labs/index.md", labs_index())
    add_generated(files, config, "reference/torchrun-flags.md", torchrun_flags_page())
    add_generated(files, config, "reference/which-parallelism.md", decision_guide.page())
    add_generated(files, config, "javascripts/error-messages.js", error_messages_script())
    for page in [ROOT / "runbooks" / "index.md", *runbook_paths()]:
        if page.exists():
            files.append(File(f"runbooks/{page.name}", str(ROOT), config.site_dir,
                              config.use_directory_urls))
    return files


def runbook_nav_groups():
    """The runbooks in the nav, grouped as runbooks/index.md groups them: one nav section per
    "## " heading there, with the pages its table links, in order. A page the index does not
    link goes in "Not in the index yet" (tests/test_site.py fails on that)."""
    index = (ROOT / "runbooks" / "index.md").read_text()
    groups, placed = [], set()
    for block in re.split(r"^## ", index, flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        pages = [p for p in dict.fromkeys(re.findall(r"\]\(([\w-]+\.md)(?:#[^)]*)?\)", body))
                 if (ROOT / "runbooks" / p).exists() and p not in placed]
        placed.update(pages)
        if pages:
            groups.append({heading.strip(): [f"runbooks/{p}" for p in pages]})
    rest = [f"runbooks/{p.name}" for p in runbook_paths() if p.name not in placed]
    return groups + ([{"Not in the index yet": rest}] if rest else [])


def on_config(config):
    lessons = [f"lessons/{p.stem}.ipynb" for p in lesson_tools.lesson_paths()]
    labs = ["labs/index.md", *[f"labs/{p.stem}.md" for p in lesson_tools.lab_paths()]]
    runbooks = ["runbooks/index.md", *runbook_nav_groups()]
    reference = sorted([*(f"reference/{p.name}" for p in (ROOT / "docs" / "reference").glob("*.md")),
                        "reference/torchrun-flags.md", "reference/which-parallelism.md"])
    onboarding = [{"Start here": "onboarding.md"}] if (ROOT / "docs" / "onboarding.md").exists() else []
    config.nav = [{"Home": "index.md"}, *onboarding, {"Lessons": lessons}, {"Labs": labs},
                  {"Runbooks": runbooks}, *([{"Reference": reference}] if reference else [])]
    return config


# Lessons are written to work in JupyterLab, where a link is a file path
# (../runbooks/index.md, ../labs/lab01_ddp.py). On the site those are .html pages.
_REPO_LINK = re.compile(r'href="((?:\.\./)*(?:lessons|labs|runbooks)/[^"#]+?)\.(md|ipynb|py)'
                        r'(#[^"]*)?"')


# Search weights, read by the search plugin from page.meta (kept here, not in front matter, so
# every page still starts with its "# <what you see>" title). A pasted log line is searched for
# its message (docs/javascripts/search-log-line.js); these settle which of the pages quoting a
# common message comes first: the one the error index names.
SEARCH_SETTINGS = {
    "runbooks/errors.md": {"exclude": True},  # the list never stands in front of the page
    "runbooks/index.md": {"boost": 0.3},      # a list of symptoms, the same
    "runbooks/collective-timeout.md": {"boost": 2},  # the gloo timeout, also on rank0-busy
    "runbooks/exit-hang.md": {"boost": 2},    # `Connection closed by peer`, quoted on 4 pages
    "runbooks/address-in-use.md": {"boost": 2},
    "runbooks/dataloader-shared-memory.md": {"boost": 2},  # /dev/shm, also on worker-killed
}
LAB_PAGE_SEARCH = {"boost": 0.05}  # the whole source and a diff match nearly any query


def search_settings(src_uri):
    if re.fullmatch(r"labs/lab\d\d_\w+\.md", src_uri):
        return LAB_PAGE_SEARCH
    return SEARCH_SETTINGS.get(src_uri)


def on_page_content(html, page, config, files):
    settings = search_settings(page.file.src_uri)
    if settings:
        page.meta["search"] = {**settings, **(page.meta.get("search") or {})}
    if page.file.src_uri.endswith(".ipynb"):
        html = _REPO_LINK.sub(lambda m: f'href="{m.group(1)}.html{m.group(3) or ""}"', html)
        facts = lesson_stamp_facts(page.file.abs_src_path)
        stamp = verified.lesson_stamp(facts) if facts else "No record of the run that executed it."
        stamp_html = f'<p class="verified-stamp"><em>{stamp}</em></p>'
        if "</h1>" in html:  # right under the lesson's title
            return html.replace("</h1>", "</h1>" + stamp_html, 1)
        return stamp_html + html
    return html


def lesson_stamp_facts(executed_notebook):
    metadata = json.loads(Path(executed_notebook).read_text()).get("metadata", {})
    return metadata.get("course", {}).get("verified")
