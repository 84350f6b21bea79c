"""Build the site in both languages: English into site/ (or --out DIR), then the Chinese
edition (mkdocs.zh.yml) into its zh/ folder. The English build empties its folder first, so
the two always build together, in this order. Usage: python tools/build_site.py [--out DIR]
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EDITIONS = [("en", "mkdocs.yml", ""), ("zh", "mkdocs.zh.yml", "zh")]


def build(out=None, quiet=False):
    """Build both editions; return {language: seconds}. Raises CalledProcessError, with
    mkdocs's own output, on the first that fails --strict."""
    out = Path(out or ROOT / "site")
    seconds = {}
    for language, config, folder in EDITIONS:
        cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config,
               "-d", str(out / folder), *(["--quiet"] if quiet else [])]
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=1800,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # no upgrade banner
        seconds[language] = time.perf_counter() - start
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the English site (default: site/)")
    args = parser.parse_args()
    seconds = build(args.out, quiet=True)
    print(" | ".join(f"{lang}: {s:.0f} s" for lang, s in seconds.items()))


if __name__ == "__main__":
    main()
