"""The grader behind exercises/grade.py: harness.py runs any exercise (ranks, timeouts, report);
one <name>_checks.py per exercise defines EXERCISE, its stub, entry points and checks.

This file imports nothing heavy: grade.py refuses an unknown exercise or a missing file with
it alone, before torch is imported.
"""

# exercise name -> the module (in this package) that defines its EXERCISE, in course order
EXERCISES = {
    "ddp": "ddp_checks",            # lesson 01
    "zero1": "zero1_checks",        # lesson 02
    "fsdp": "fsdp_checks",          # lesson 02
    "tp": "tp_checks",              # lesson 03
    "pipeline": "pipeline_checks",  # lesson 04
    "ring": "ring_checks",          # lesson 07
    "moe": "moe_checks",            # lesson 08
}
