"""Build the site in both languages: English into site/ (or --out DIR), the Chinese edition
(mkdocs.zh.yml) into its zh/ folder. The two builds run at the same time (each is one busy
core for about a minute). The English build empties its folder first, so the Chinese one
builds beside it and moves into zh/ once both have passed --strict.
Usage: python tools/build_site.py [--out DIR]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EDITIONS = [("en", "mkdocs.yml", ""), ("zh", "mkdocs.zh.yml", "zh")]


def build(out=None, quiet=False):
    """Build both editions; return {language: seconds}. Raises CalledProcessError, with
    mkdocs's own output, if either fails --strict."""
    out = Path(out or ROOT / "site")
    staging = out.with_name(out.name + ".zh-building")
    shutil.rmtree(staging, ignore_errors=True)
    targets = {language: (out / folder if language == "en" else staging)
               for language, _, folder in EDITIONS}
    started, builds = {}, {}
    for language, config, _ in EDITIONS:
        cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config,
               "-d", str(targets[language]), *(["--quiet"] if quiet else [])]
        started[language] = time.perf_counter()
        log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: neither build can block
        builds[language] = (cmd, log, subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}))  # no upgrade banner
    seconds, failed = {}, None
    for language, (cmd, log, proc) in builds.items():
        proc.wait(timeout=1800)
        seconds[language] = time.perf_counter() - started[language]
        log.seek(0)
        output = log.read()
        sys.stdout.write(output)
        if proc.returncode != 0 and failed is None:
            failed = subprocess.CalledProcessError(proc.returncode, cmd, output)
    if failed:
        shutil.rmtree(staging, ignore_errors=True)
        raise failed
    shutil.rmtree(out / "zh", ignore_errors=True)
    staging.rename(out / "zh")
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the English site (default: site/)")
    args = parser.parse_args()
    seconds = build(args.out, quiet=True)
    print(" | ".join(f"{lang}: {s:.0f} s" for lang, s in seconds.items()))


if __name__ == "__main__":
    main()
