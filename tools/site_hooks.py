"""MkDocs hooks: assemble the site from the repo as it is, so nothing is pasted by hand.

- lessons/NN_*.py  -> lessons/NN_*.ipynb pages, from the executed notebooks (tools/lessons.py;
  a lesson whose cached execution is stale or missing is executed now);
- labs/labNN_*.py  -> labs/labNN_*.md pages: docstring, run command, source included from the
  file, and a diff against the previous lab generated here;
- runbooks/*.md    -> runbooks/ pages, as they are;
- the nav is built from what exists, in course order.
"""

import difflib
import hashlib
import json
import logging
import posixpath
import re
import sys
import textwrap
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lessons as lesson_tools  # noqa: E402  (tools/lessons.py)
import error_index  # noqa: E402  (tools/error_index.py)
import i18n  # noqa: E402  (tools/i18n.py: where each Chinese page lives)
import site_i18n  # noqa: E402  (tools/site_i18n.py: the Chinese edition)
import verified  # noqa: E402  (tools/verified.py)

ROOT = Path(__file__).resolve().parents[1]



def runbook_paths():
    return sorted(p for p in (ROOT / "runbooks").glob("*.md") if p.name != "index.md")


def docstring(path):
    """The module docstring as Python sees it (escapes such as a trailing \\ resolved)."""
    return i18n.lab_docstring(path).strip()


_GUIDE = re.compile(r"^(?:Use it in your project:|在你的项目中使用：)\n((?:  .*(?:\n|$))+)", re.M)


def project_guide(doc):
    """Split the docstring's "Use it in your project:" block off as markdown (labels in bold,
    runbook paths as links); return (markdown or None, the rest of the docstring)."""
    match = _GUIDE.search(doc)
    if not match:
        return None, doc
    lines = [line[2:] for line in match.group(1).rstrip().splitlines()]
    guide = re.sub(r"^- (Replace|Keep|Pitfalls|替换|保留|陷阱)(:|：)", r"- **\1\2**",
                   "\n".join(lines), flags=re.M)
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


# The words of the generated lab pages, per language; {placeholders} are filled per lab.
LAB_PAGE_WORDS = {
    "en": {
                "verified": "Verified", "unverified": "Not verified in this build",
        "unverified_body": "No run of this lab was recorded (`make test` and `make course` "
                           "record them).",
        "gpu_verified": "Verified on GPU", "gpu_unverified": "Not yet verified on a GPU",
        "gpu_unverified_body": "No `make gpu-check` run is recorded (`verified/gpu-check.jsonl`). "
                               "The CUDA path is tested on CPU with faked devices "
                               "(`tests/test_gpu_defaults.py`); nothing here was measured on a GPU.",
        "download": "Download",
        "run": "Run it", "guide": "Use it in your project", "plan": "Plan a big run",
        "plan_body": "What the lab would do on hardware this machine does not have; it starts "
                     "no process group. Run at build time:",
        "course_output": "Output of the last `make course` run", "source_heading": "Source",
        "changed": "What changed since `{previous}`",
        "labs_title": "Labs",
        "labs_intro": "One torchrun script per lesson; each runs on CPU (gloo) and on GPUs "
                      "(NCCL) unchanged.",
        "labs_header": "| lab | what it teaches | command |",
        "kit_source": "Source: `labs/{name}`, the technique in the order it happens, on the lab "
                      "kit beside it, [`labs/labkit/`](labkit.md): copy both and run it "
                      "anywhere with torch installed.",
        "kit_full": "the lab, {lines} lines.",
        "kit_zip": "the lab and the kit, ready to unpack into a project ({lines} lines of kit).",
        "from_kit": "What it takes from the kit",
        "from_kit_body": "Everything the lab uses but does not teach, by the kit module it "
                         "comes from:",
        "kit_title": "The lab kit",
        "kit_intro": "Everything a lab uses but does not teach, written once: `labs/labkit/`, "
                     "torch and the standard library only. A lab is copied together with this "
                     "folder. One module per concern:",
        "kit_line": "The labs on the kit import everything else from [the lab kit](labkit.md).",
        "kit_changed_body": "Generated at build time; both labs take everything they do not "
                            "teach from the kit, so the diff is the new technique.",
    },
    "zh": {
        "verified": "已验证", "unverified": "本次构建未验证",
        "unverified_body": "没有记录到这个实验的运行（`make test` 和 `make course` 会记录）。",
        "gpu_verified": "已在 GPU 上验证", "gpu_unverified": "尚未在 GPU 上验证",
        "gpu_unverified_body": "没有记录到 `make gpu-check` 的运行（`verified/gpu-check.jsonl`）。"
                               "CUDA 路径在 CPU 上用模拟的设备测试（`tests/test_gpu_defaults.py`）；"
                               "这里没有任何数字是在 GPU 上测得的。",
        "download": "下载",
        "run": "运行", "guide": "在你的项目中使用", "plan": "规划一次大规模运行",
        "plan_body": "实验在本机没有的硬件上会怎么做；它不启动任何进程组。构建时运行：",
        "course_output": "最近一次 `make course` 的输出", "source_heading": "源码",
        "changed": "相对 `{previous}` 的改动",
        "labs_title": "实验",
        "labs_intro": "每课一个 torchrun 脚本；每个脚本在 CPU（gloo）和 GPU（NCCL）上不加修改即可运行。",
        "labs_header": "| 实验 | 教什么 | 命令 |",
        "kit_source": "源码：`labs/{name}`，按发生顺序写出的技术本身，建立在旁边的实验工具包 "
                      "[`labs/labkit/`](labkit.md) 之上：把两者一起复制到任何装有 torch 的地方即可运行。",
        "kit_full": "实验本身，{lines} 行。",
        "kit_zip": "实验加实验工具包，解压到项目中即可使用（工具包共 {lines} 行）。",
        "from_kit": "它从实验工具包中用到什么",
        "from_kit_body": "实验用到但不讲授的一切，按所在的工具包模块列出：",
        "kit_title": "实验工具包",
        "kit_intro": "实验用到但不讲授的一切，只写一次：`labs/labkit/`，只依赖 torch 和标准库。"
                     "复制实验时连同这个文件夹一起复制。每个模块负责一件事：",
        "kit_line": "建立在工具包上的实验，其余的一切都从[实验工具包](labkit.md)导入。",
        "kit_changed_body": "构建时生成；两个实验都从工具包导入不讲授的部分，所以 diff 就是新技术本身。",
    },
}


def lab_docstring(lab, lang):
    """The docstring the page shows: the lab's own, or its translation (i18n/zh/labs/)."""
    if lang == "en":
        return docstring(lab)
    return i18n.zh_path(lab).read_text().strip()


KIT = ROOT / "labs" / "labkit"


def kit_modules():
    return sorted(p for p in KIT.glob("*.py") if p.name != "__init__.py")


def zip_of(folder, files):
    """The bytes of a zip of files ([(path on disk, name under folder/)]), reproducible: a
    fixed date, so that the same sources give the same zip, build after build."""
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, name in files:
            entry = zipfile.ZipInfo(f"{folder}/{name}", date_time=(2020, 1, 1, 0, 0, 0))
            entry.external_attr = 0o644 << 16
            archive.writestr(entry, path.read_bytes(), zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


def lab_with_kit_zip(lab):
    """The bytes of {stem}.zip: the lab and labkit/, as a project copies them."""
    return zip_of(lab.stem, [(lab, lab.name),
                             *((m, f"labkit/{m.name}") for m in sorted(KIT.glob("*.py")))])


def lesson_zip(notebook, lesson):
    """The bytes of {lesson}.zip, the lesson as a reader takes it away: the executed notebook
    in lessons/, beside the worker modules lessons start processes from, and labs/ (the labs,
    their kit and tools) one folder up, where a lesson looks for them. It runs with torch,
    matplotlib and JupyterLab installed, from anywhere."""
    workers = sorted(p for p in (ROOT / "lessons").glob("*.py")
                     if not re.match(r"\d\d_", p.name))
    labs = sorted(p for p in (ROOT / "labs").rglob("*.py") if "__pycache__" not in p.parts)
    return zip_of(lesson.stem, [(notebook, f"lessons/{lesson.stem}.ipynb"),
                                *((p, f"lessons/{p.name}") for p in workers),
                                *((p, str(p.relative_to(ROOT))) for p in labs)])


def kit_imports(lab):
    """{kit module: [names the lab takes from it]}, in the order the lab imports them: the
    names of `from labkit.m import a, b`, and for `from labkit import m` every `m.name` the lab
    uses."""
    import ast

    tree = ast.parse(lab.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit."):
            found.setdefault(node.module.split(".", 1)[1], []).extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "labkit":
            for alias in node.names:
                local = alias.asname or alias.name
                used = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                        and isinstance(n.value, ast.Name) and n.value.id == local]
                found.setdefault(alias.name, []).extend(dict.fromkeys(used))
    return found


def kit_section(lab, say):
    rows = [f"- [`{module}`](labkit.md#{module}): " + ", ".join(f"`{n}`" for n in names)
            for module, names in kit_imports(lab).items()]
    return [f"## {say['from_kit']} {{#from-the-kit}}", "", say["from_kit_body"], "", *rows, ""]


def kit_page(lang="en"):
    say = LAB_PAGE_WORDS[lang]
    lines = [f"# {say['kit_title']}", "", say["kit_intro"], "", "```text",
             textwrap.dedent(docstring(KIT / "__init__.py").split("One module per concern:")[1])
             .strip("\n"),
             "```", ""]
    for module in kit_modules():
        first = docstring(module).split("\n\n")[0].replace("\n", " ")
        lines += [f"## `labkit/{module.name}` {{#{module.stem}}}", "", first, "",
                  "```python", f'--8<-- "labs/labkit/{module.name}"', "```", ""]
    return "\n".join(lines)


def downloads(lab, say):
    """Markdown for the files a reader can take: the lab, and a zip of the lab with the kit."""
    kit_lines = sum(len(p.read_text().splitlines()) for p in KIT.glob("*.py"))
    return [f"## {say['download']} {{#download}}", "",
            f"- [`{lab.name}`](../downloads/{lab.name}): "
            + say["kit_full"].format(lines=len(lab.read_text().splitlines())),
            f"- [`{lab.stem}.zip`](../downloads/{lab.stem}.zip): "
            + say["kit_zip"].format(lines=kit_lines), ""]


def lab_page(lab, previous, lang="en"):
    say = LAB_PAGE_WORDS[lang]
    guide, doc = project_guide(lab_docstring(lab, lang))
    title, _, rest = doc.partition("\n")
    stamp, gpu_stamp = verified.lab_stamp(lab.stem), verified.gpu_stamp(lab.stem)
    plan_cmd, plan_out = plan_example(lab)
    lines = [f"# {title}", "",
             say["kit_source"].format(name=lab.name), "",
             f"!!! success \"{say['verified']}\"\n    {stamp}" if stamp
             else f"!!! warning \"{say['unverified']}\"\n    {say['unverified_body']}", "",
             f"!!! success \"{say['gpu_verified']}\"\n    {gpu_stamp}" if gpu_stamp
             else f"!!! note \"{say['gpu_unverified']}\"\n    {say['gpu_unverified_body']}", "",
             *downloads(lab, say),
             "```text", rest.strip(), "```", "",
             f"## {say['run']} {{#run-it}}", "", "```bash",
             f"torchrun --standalone --nproc-per-node 2 labs/{lab.name} --check-parity", "```", ""]
    if guide:
        lines += [f"## {say['guide']} {{#use-it-in-your-project}}", "", guide, ""]
    lines += kit_section(lab, say)
    lines += [f"## {say['plan']} {{#plan-a-big-run}}", "", say["plan_body"], "", "```bash",
              plan_cmd, "```", "", "```text", plan_out, "```", ""]
    log = ROOT / "build" / "course" / f"{lab.stem}.log"
    if log.exists():
        output = [line for line in log.read_text().splitlines() if not line.startswith("W")]
        lines += [f"## {say['course_output']} {{#output-of-the-last-make-course-run}}", "",
                  "```text", *output[-12:], "```", ""]
    lines += [f"## {say['source_heading']} {{#source}}", "", "```python",
              f'--8<-- "labs/{lab.name}"', "```", ""]
    if previous is not None:
        diff = difflib.unified_diff(previous.read_text().splitlines(),
                                    lab.read_text().splitlines(),
                                    f"labs/{previous.name}", f"labs/{lab.name}", lineterm="")
        anchor = "what-changed-since-" + previous.name.replace(".", "")
        lines += [f"## {say['changed'].format(previous=previous.name)} {{#{anchor}}}", "",
                  say["kit_changed_body"], "",
                  "```diff", *diff,
                  "```", ""]
    return "\n".join(lines)


def labs_index(lang="en"):
    say = LAB_PAGE_WORDS[lang]
    rows = [say["labs_header"], "|---|---|---|"]
    for lab in lesson_tools.lab_paths():
        title = lab_docstring(lab, lang).splitlines()[0]
        rows.append(f"| [{lab.stem}]({lab.stem}.md) | {title} | "
                    f"`torchrun --standalone --nproc-per-node 2 labs/{lab.name}` |")
    return (f"# {say['labs_title']}\n\n{say['labs_intro']} {say['kit_line']}\n\n"
            + "\n".join(rows) + "\n")


TORCHRUN_FLAGS_WORDS = {
    "en": ("torchrun flags", "| flag | default | what it does |",
           "Generated at build time from `torch.distributed.run.get_args_parser()`, the parser "
           "torchrun itself uses. The defaults shown are the parser's; [launching](launching.md) "
           "explains the ones that are resolved later."),
    "zh": ("torchrun 参数", "| 参数 | 默认值 | 作用（torch 自带的英文说明） |",
           "构建时由 `torch.distributed.run.get_args_parser()` 生成，也就是 torchrun 自己使用的"
           "解析器。表中的默认值是解析器里的；其中运行时才确定的那些，见"
           "[启动](launching.md)。第三列是 torch 自带的说明，保持英文原文，便于对照 `torchrun --help`。"),
}


def torchrun_flags_page(lang="en"):
    """The flag table straight from the parser torchrun uses, so defaults are never retyped."""
    import torch
    from torch.distributed.run import get_args_parser

    title, header, intro = TORCHRUN_FLAGS_WORDS[lang]
    rows = [header, "|---|---|---|"]
    for action in get_args_parser()._actions:
        if not action.option_strings or "--help" in action.option_strings:
            continue
        flag = " ".join(f"`{o}`" for o in action.option_strings if "_" not in o)
        helptext = " ".join((action.help or "").split()).replace("|", "\\|")
        rows.append(f"| {flag} | `{action.default!r}` | {helptext} |")
    return f"# {title} (torch {torch.__version__})\n\n{intro}\n\n" + "\n".join(rows) + "\n"


def message_token(message):
    """One search token that stands for a message of the error index: lowercase letters and
    digits, which the site's search separator never splits."""
    return "msg" + hashlib.sha1(message.encode()).hexdigest()[:12]


def pages_quoting(messages):
    """{message: how many English pages quote it}: the runbooks and the reference pages, the
    error index left out. The fewer, the more a message says which page explains a line."""
    pages = [p.read_text() for p in [*(ROOT / "runbooks").glob("*.md"),
                                     *(ROOT / "docs").rglob("*.md")]
             if p.name != "errors.md"]
    return {m: sum(m in text for text in pages) for m in messages}


def error_messages_script():
    """The error index's messages for the search box, longest first, each with its search
    token (the "messages" field of the section that explains it holds the token) and the
    pages quoting it: a pasted log line is searched for the known message it contains
    (docs/javascripts/search-log-line.js)."""
    messages = sorted({e.message for e in error_index.parse_index()}, key=lambda m: (-len(m), m))
    quoted = pages_quoting(messages)
    entries = [{"message": m, "token": message_token(m), "pages": quoted[m]} for m in messages]
    return f"window.courseErrorMessages = {json.dumps(entries, indent=0)};\n"


def add_generated(files, config, src_uri, content):
    files.append(File.generated(config, src_uri, content=content))


# zh build: the English text of each page (src_uri -> markdown), for the headings' anchors.
ENGLISH_MARKDOWN = {}


@event_priority(100)  # before mkdocs-jupyter turns .ipynb files into pages
def on_files(files, config):
    lang = site_i18n.language(config)
    ENGLISH_MARKDOWN.clear()
    # Real File objects (not File.generated): mkdocs-jupyter 0.26 loses the source path of
    # generated files when it wraps them.
    for lesson in lesson_tools.lesson_paths():
        lesson_tools.ensure_executed(lesson)
        if lang == "en":
            root = lesson_tools.EXECUTED_ROOT
        else:  # the English outputs, the Chinese prose: nothing is executed twice
            site_i18n.zh_notebook(lesson, lesson_tools.executed_path(lesson))
            root = site_i18n.EXECUTED_ZH_ROOT
        files.append(File(f"lessons/{lesson.stem}.ipynb", str(root), config.site_dir,
                          config.use_directory_urls))
        add_generated(files, config, f"downloads/{lesson.stem}.zip",
                      lesson_zip(Path(root) / "lessons" / f"{lesson.stem}.ipynb", lesson))
    previous = None
    for lab in lesson_tools.lab_paths():
        add_generated(files, config, f"labs/{lab.stem}.md", lab_page(lab, previous, lang))
        add_generated(files, config, f"downloads/{lab.name}", lab.read_text())
        add_generated(files, config, f"downloads/{lab.stem}.zip", lab_with_kit_zip(lab))
        previous = lab
    add_generated(files, config, "labs/labkit.md", kit_page(lang))
    add_generated(files, config, "labs/index.md", labs_index(lang))
    add_generated(files, config, "reference/torchrun-flags.md", torchrun_flags_page(lang))
    add_generated(files, config, "javascripts/error-messages.js", error_messages_script())
    # The exercises track: its README, the page a code host shows for exercises/, in each language.
    exercises = ROOT / "exercises" / "README.md"
    add_generated(files, config, "exercises/README.md",  # MkDocs serves it as exercises/index
                  (exercises if lang == "en" else i18n.zh_path(exercises)).read_text())
    if lang != "en":
        ENGLISH_MARKDOWN["exercises/README.md"] = exercises.read_text()
    runbooks_root = ROOT if lang == "en" else site_i18n.ZH  # holds runbooks/
    for name in ["index.md", *(p.name for p in runbook_paths())]:
        if (runbooks_root / "runbooks" / name).exists():
            files.append(File(f"runbooks/{name}", str(runbooks_root), config.site_dir,
                              config.use_directory_urls))
    if lang != "en":
        for name in ["index.md", *(p.name for p in runbook_paths())]:
            ENGLISH_MARKDOWN[f"runbooks/{name}"] = (ROOT / "runbooks" / name).read_text()
        for english in (ROOT / "docs").rglob("*"):
            relative = english.relative_to(ROOT / "docs").as_posix()
            if english.suffix == ".md":
                ENGLISH_MARKDOWN[relative] = english.read_text()
            elif english.is_file() and files.get_file_from_path(relative) is None:
                files.append(File(relative, str(ROOT / "docs"), config.site_dir,
                                  config.use_directory_urls))  # the scripts, shared
    return files


def on_page_markdown(markdown, page, config, files):
    """zh: each heading of a translated page gets the English page's anchor."""
    english = ENGLISH_MARKDOWN.get(page.file.src_uri)
    if site_i18n.language(config) == "en" or english is None:
        return markdown
    markdown = site_i18n.with_english_anchors(markdown, english, config, page.file.src_uri)
    if page.file.src_uri == "reference/glossary.md":  # the terms the Chinese pages use
        markdown += "\n\n" + site_i18n.terms_section()
    return markdown


def on_page_context(context, page, config, nav):
    """The language switcher of this page: the same page in each language."""
    config.extra["alternate"] = site_i18n.alternate_links(page.url, config)
    return context


def runbook_nav_groups(lang="en"):
    """The runbooks in the nav, grouped as runbooks/index.md groups them: one nav section per
    "## " heading there, with the pages its table links, in order. A page the index does not
    link goes in "Not in the index yet" (tests/test_site.py fails on that)."""
    root = ROOT if lang == "en" else site_i18n.ZH
    index = (root / "runbooks" / "index.md").read_text()
    groups, placed = [], set()
    for block in re.split(r"^## ", index, flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        pages = [p for p in dict.fromkeys(re.findall(r"\]\(([\w-]+\.md)(?:#[^)]*)?\)", body))
                 if (ROOT / "runbooks" / p).exists() and p not in placed]
        placed.update(pages)
        if pages:
            groups.append({heading.strip(): [f"runbooks/{p}" for p in pages]})
    rest = [f"runbooks/{p.name}" for p in runbook_paths() if p.name not in placed]
    not_indexed = site_i18n.WORDS[lang]["Not in the index yet"]
    return groups + ([{not_indexed: rest}] if rest else [])


def on_config(config):
    lang, say = site_i18n.language(config), site_i18n.words(config)
    docs = ROOT / "docs" if lang == "en" else site_i18n.ZH / "docs"
    lessons = [f"lessons/{p.stem}.ipynb" for p in lesson_tools.lesson_paths()]
    labs = ["labs/index.md", *[f"labs/{p.stem}.md" for p in lesson_tools.lab_paths()],
            "labs/labkit.md"]
    runbooks = ["runbooks/index.md", *runbook_nav_groups(lang)]
    reference = sorted([*(f"reference/{p.name}" for p in (docs / "reference").glob("*.md")),
                        "reference/torchrun-flags.md"])
    # The onboarding plan, then its exercise book and the mentor's rubric.
    onboarding = [p for p in ("onboarding.md", "onboarding-exercises.md", "onboarding-rubric.md")
                  if (docs / p).exists()]
    onboarding = [{say["Start here"]: onboarding}] if onboarding else []
    config.nav = [{say["Home"]: "index.md"}, *onboarding, {say["Lessons"]: lessons},
                  {say["Labs"]: labs}, {say["Exercises"]: "exercises/README.md"},
                  {say["Runbooks"]: runbooks},
                  *([{say["Reference"]: reference}] if reference else [])]
    return config


def on_startup(command, dirty):
    """Before any plugin loads its configuration: the search plugin segments Chinese with
    jieba, which logs loading its dictionaries (the user dictionary too, while the plugin
    reads its config) at DEBUG level to stderr, "Building prefix dict ...": noise."""
    import jieba

    jieba.setLogLevel(logging.WARNING)


def on_template_context(context, template_name, config):
    """Pages without a page (404.html) are served from any path: no language switcher."""
    config.extra["alternate"] = []
    return context


# Lessons are written to work in JupyterLab, where a link is a file path
# (../runbooks/index.md, ../labs/lab01_ddp.py, ../exercises/README.md, ../docs/onboarding.md,
# or a sibling lesson, 06_performance.ipynb#section). On the site those are .html pages (a
# README is its folder's index, and docs/ is the site's root).
_REPO_LINK = re.compile(r'href="((?:\.\./)*(?:lessons|labs|runbooks|exercises|docs)/[^"#]+?'
                        r'|\d\d_\w+)\.(md|ipynb|py)(#[^"]*)?"')


def site_link(match):
    path = re.sub(r"(^|/)README$", r"\1index", match.group(1))
    path = re.sub(r"(^|/)docs/", r"\1", path)
    return f'href="{path}.html{match.group(3) or ""}"'


# Search weights, read by the search plugin from page.meta (kept here, not in front matter, so
# every page still starts with its "# <what you see>" title). Which page a pasted log line
# finds is settled by the error index (MESSAGES_FIELD), not by weights.
SEARCH_SETTINGS = {
    "runbooks/errors.md": {"exclude": True},  # the list never stands in front of the page
    "runbooks/index.md": {"boost": 0.3},      # a list of symptoms, the same
    # Where an out-of-memory error starts: the words a reader types for one (CUDA out of
    # memory, 显存不足) are on all five OOM pages.
    "runbooks/oom-reading-the-error.md": {"boost": 4},
}
LAB_PAGE_SEARCH = {"boost": 0.05}  # the whole source and a diff match nearly any query


# The search index's field for what a section explains: the error index's messages that link
# to it (both mkdocs configs give the field a boost above a title's). A pasted log line is
# searched for the messages it contains, so the section the index names comes first, however
# many other pages quote the same words.
MESSAGES_FIELD = "messages"


def explained_messages():
    """{search index location ("runbooks/page.html#anchor"): [each message linked there, and its
    token]}, from the error index."""
    explained = {}
    for entry in error_index.parse_index():
        page, _, anchor = entry.page.partition("#")
        html = posixpath.normpath(posixpath.join("runbooks", page.replace(".md", ".html")))
        location = html + (f"#{anchor}" if anchor else "")
        explained.setdefault(location, []).extend([entry.message, message_token(entry.message)])
    return explained


def search_aliases(lang):
    """{search index location of a page: [the aliases readers search it by]}: the Chinese
    edition's i18n/zh/search-aliases.yml (the English has none)."""
    import yaml

    aliases_file = site_i18n.ZH / "search-aliases.yml"
    if lang == "en" or not aliases_file.exists():
        return {}
    aliases = {}
    for entry in yaml.safe_load(aliases_file.read_text()):
        aliases.setdefault(entry["page"].replace(".md", ".html"), []).append(entry["alias"])
    return aliases


@event_priority(-100)  # after the search plugin has written its index
def on_post_build(config):
    """Give each section the error index links to the messages it explains, and each page
    the aliases it is searched by, in MESSAGES_FIELD."""
    path = Path(config.site_dir) / "search" / "search_index.json"
    index = json.loads(path.read_text())
    explained = explained_messages()
    for location, aliases in search_aliases(site_i18n.language(config)).items():
        explained.setdefault(location, []).extend(aliases)
    for doc in index["docs"]:
        if doc["location"] in explained:
            doc[MESSAGES_FIELD] = "\n".join(explained.pop(doc["location"]))
    if explained:  # a link of the index to a section the search does not have
        raise ValueError(f"error index or search aliases point at sections missing from the "
                         f"search index of {config.site_dir}: {sorted(explained)}")
    path.write_text(json.dumps(index, ensure_ascii=False, separators=(",", ":")))


def search_settings(src_uri):
    if re.fullmatch(r"labs/lab\d\d_\w+\.md", src_uri):
        return LAB_PAGE_SEARCH
    return SEARCH_SETTINGS.get(src_uri)


LESSON_DOWNLOAD_WORDS = {
    "en": ("Take this lesson away: {zip}, the notebook with the worker modules and labs it "
           "runs. Unzip it anywhere and open <code>lessons/{stem}.ipynb</code> in JupyterLab, "
           "with torch, matplotlib and JupyterLab installed."),
    "zh": ("带走这一课：{zip}，包含 notebook 以及它运行的 worker 模块和实验。解压到任意位置，在装好 "
           "torch、matplotlib 和 JupyterLab 的环境中，用 JupyterLab 打开 "
           "<code>lessons/{stem}.ipynb</code>。"),
}


def lesson_download(stem, lang):
    """The lesson page's download line (the zip is lesson_zip's)."""
    link = f'<a href="../downloads/{stem}.zip" download><code>{stem}.zip</code></a>'
    words = LESSON_DOWNLOAD_WORDS[lang].format(zip=link, stem=stem)
    return f'<p class="lesson-download">{words}</p>'


def on_page_content(html, page, config, files):
    settings = search_settings(page.file.src_uri)
    if settings:
        page.meta["search"] = {**settings, **(page.meta.get("search") or {})}
    if page.file.src_uri.endswith(".ipynb"):
        html = _REPO_LINK.sub(site_link, html)
        if site_i18n.language(config) != "en":  # the English lesson's anchors
            english = lesson_tools.executed_path(Path(page.file.src_uri).stem + ".py")
            html = site_i18n.lesson_with_english_anchors(
                html, page.toc, site_i18n.notebook_heading_ids(english), page.file.src_uri)
        facts = lesson_stamp_facts(page.file.abs_src_path)
        stamp = verified.lesson_stamp(facts) if facts else "No record of the run that executed it."
        stamp_html = (f'<p class="verified-stamp"><em>{stamp}</em></p>'
                      + lesson_download(Path(page.file.src_uri).stem, site_i18n.language(config)))
        if "</h1>" in html:  # right under the lesson's title
            return html.replace("</h1>", "</h1>" + stamp_html, 1)
        return stamp_html + html
    return html


def lesson_stamp_facts(executed_notebook):
    metadata = json.loads(Path(executed_notebook).read_text()).get("metadata", {})
    return metadata.get("course", {}).get("verified")
