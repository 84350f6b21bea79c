"""The grader behind exercises/grade.py: harness.py runs any exercise (ranks, timeouts, report);
one <name>_checks.py per exercise defines EXERCISE, its stub, entry points and checks.

This file imports nothing heavy: grade.py refuses an unknown exercise or a missing file with
it alone, before torch is imported.
"""

# exercise name -> the module (in this package) that defines its EXERCISE
EXERCISES = {
    "ddp": "ddp_checks",
    "zero1": "zero1_checks",
}
