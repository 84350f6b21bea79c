"""Grade an exercise: does your implementation compute what one process computes?

    python exercises/grade.py ddp                         # grades your copy, exercises/ddp.py
    python exercises/grade.py zero1 path/to/my_zero1.py   # grades any file with the contract
    python exercises/grade.py ddp --timeout 10            # seconds a check may run (30)

Exercises, in course order: ddp (DDP by hand), zero1 (a ZeRO-1 sharded optimizer), fsdp
(FSDP by hand), tp (tensor parallel by hand), pipeline (GPipe and 1F1B by hand), ring (ring
attention by hand), moe (MoE dispatch and combine). The grader starts its own
ranks (2, or 3 where uneven splits matter) on gloo on 127.0.0.1, so run it with plain
python, not torchrun. It prints one line per check (PASS/FAIL, the check, what differed and
by how much) and a verdict; the exit status is 0 only when every check passed. It refuses,
in one line with exit status 2, an unknown exercise, a missing file, a file that does not
import, and a file without the names the grader calls (see the adapter in each stub).
See exercises/README.md.
"""

import argparse
import sys
from pathlib import Path

from grading import EXERCISES

HERE = Path(__file__).resolve().parent


def refuse(message):
    print(f"grade.py: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exercise", help=f"one of: {', '.join(EXERCISES)}")
    parser.add_argument("solution", nargs="?",
                        help="the file to grade (default: exercises/<exercise>.py)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds one check may run before the grader calls it a hang")
    args = parser.parse_args(argv)
    if args.exercise not in EXERCISES:
        refuse(f"unknown exercise {args.exercise!r}; choose one of: {', '.join(EXERCISES)}")
    if args.timeout <= 0:
        refuse(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    path = Path(args.solution) if args.solution else HERE / f"{args.exercise}.py"
    if not path.is_file():
        refuse(f"no such file: {path}")

    from grading import harness  # imports torch: only once the input is known to be good
    from grading.solution import Refusal

    try:
        exercise = harness.load_exercise(args.exercise)
        sys.exit(harness.grade(exercise, path.resolve(), args.timeout))
    except Refusal as refusal:
        refuse(refusal)
    except KeyboardInterrupt:  # the ranks are daemons: they go with this process
        print("grade.py: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
