"""Bad input gets one line on stderr and exit status 2, before any process group starts."""

import argparse
import sys
from pathlib import Path


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; a lab prints one line and exits 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail_config(flag, message):
    """Reject a bad value before any process group exists: one line, exit status 2."""
    print(f"{Path(sys.argv[0]).name}: error: {flag}: {message}", file=sys.stderr)
    sys.exit(2)


def refuse_negative(cfg, names, strictly_positive=False):
    """fail_config on the first of these flags that is < 0 (or <= 0 when strictly_positive)."""
    for name in names:
        value = getattr(cfg, name)
        if value < 0 or (strictly_positive and value == 0):
            bound = "> 0" if strictly_positive else ">= 0"
            fail_config(f"--{name.replace('_', '-')}", f"must be {bound}, got {value}")
