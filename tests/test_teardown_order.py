"""Every script that wraps a model (DDP, fully_shard) frees it before destroy_process_group().

runbooks/exit-hang.md, cause D: a wrapped model that outlives its process group tears the gloo
group down from a destructor with the GIL held, and the rank aborts at exit ("terminate called
without an active exception") or hangs, in some runs only. This course's CI hit it in lab02
and, later, in the checkpoint drill, so the rule is checked on the source, where a race
cannot hide it:
  - the function that calls destroy_process_group() calls no wrapper itself, and
  - it calls gc.collect() before it (the wrappers sit in reference cycles).
A source check cannot see a model returned into that function by a helper; the labs keep the
model inside run(), which returns only results. Most lab tests fork their ranks (tests/zygote.py),
which leave through os._exit and skip the interpreter's shutdown, where these hangs happen; every
lab also runs once per suite under real torchrun with a real interpreter exit (`make course`,
tests/test_readme_commands.py, which fails on an abort message or a non-zero exit). A lab on the
kit destroys the group in labs/labkit/runtime.py's teardown_distributed(), checked here too.
hang_exit.py is left out by name: its ddp-outlives-group case keeps the bug on purpose, and
test_runbook_hangs runs it both ways (the broken case aborts, the fixed one exits 0).
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p for folder in ("labs", "runbooks/drills", "capstone", "tests/capstone")
    for p in (ROOT / folder).glob("*.py"))
WRAPPERS = {"DDP", "DistributedDataParallel", "fully_shard"}
KEEPS_THE_BUG_ON_PURPOSE = "hang_exit.py"
KIT_RUNTIME = ROOT / "labs" / "labkit" / "runtime.py"


def call_name(node):
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def calls(function):
    return [n for n in ast.walk(function) if isinstance(n, ast.Call)]


def wraps_a_model(tree):
    return any(call_name(c) in WRAPPERS for c in calls(tree))


def teardown_functions(tree):
    """Functions that destroy the default group (a call with no group argument)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            destroys = [c for c in calls(node) if call_name(c) == "destroy_process_group"
                        and not c.args and not c.keywords]
            if destroys:
                yield node, destroys


def uses_the_kits_teardown(tree):
    """Whether a script takes its teardown from the kit (teardown_distributed, or launch,
    which calls it in a finally)."""
    return any(isinstance(node, ast.ImportFrom) and node.module == "labkit.runtime"
               and {"teardown_distributed", "launch"} & {a.name for a in node.names}
               for node in ast.walk(tree))


def check_teardown(path, function, destroys):
    builds = [call_name(c) for c in calls(function) if call_name(c) in WRAPPERS]
    assert not builds, (f"{path.name}:{function.name} wraps a model ({builds}) in the "
                        "function that destroys the group: the model is still alive there")
    collects = [c.lineno for c in calls(function)
                if call_name(c) == "collect" and getattr(c.func.value, "id", "") == "gc"]
    for destroy in destroys:
        assert any(line < destroy.lineno for line in collects), (
            f"{path.name}:{destroy.lineno}: destroy_process_group() with no gc.collect() "
            f"before it in {function.name}()")


def test_the_kits_teardown_collects_before_it_destroys_the_group():
    found = list(teardown_functions(ast.parse(KIT_RUNTIME.read_text())))
    assert [function.name for function, _ in found] == ["teardown_distributed"]
    for function, destroys in found:
        check_teardown(KIT_RUNTIME, function, destroys)


def wrapping_scripts():
    return [p for p in SCRIPTS if p.name != KEEPS_THE_BUG_ON_PURPOSE
            and wraps_a_model(ast.parse(p.read_text()))]


def test_the_check_sees_the_scripts_that_wrap_models():
    names = {p.name for p in wrapping_scripts()}
    assert {"lab01_ddp.py", "lab02_fsdp.py", "checkpoint_save_memory.py",
            "dataloader_slow_input.py", "port_fsdp2.py"} <= names, names


@pytest.mark.parametrize("script", wrapping_scripts(), ids=lambda p: p.name)
def test_the_model_is_freed_before_the_group_is_destroyed(script):
    tree = ast.parse(script.read_text())
    checked = 0
    for function, destroys in teardown_functions(tree):
        checked += 1
        check_teardown(script, function, destroys)
    assert checked or uses_the_kits_teardown(tree), \
        f"{script.name} wraps a model but never destroys its group"


def test_the_check_fails_on_the_patterns_that_aborted():
    """The two drills as they were: the checkpoint drill built its model through a helper in
    main() and collected nothing; the data loader drill wrapped DDP in main()."""
    checkpoint_drill = ast.parse(
        "def main():\n"
        "    model = build_model(args)\n"
        "    run(model)\n"
        "    dist.destroy_process_group()\n")
    (function, _), = teardown_functions(checkpoint_drill)
    assert not [c for c in calls(function) if call_name(c) == "collect"]
    loader_drill = ast.parse(
        "def main():\n"
        "    ddp_model = DDP(model)\n"
        "    gc.collect()\n"
        "    dist.destroy_process_group()\n")
    (function, _), = teardown_functions(loader_drill)
    assert [call_name(c) for c in calls(function) if call_name(c) in WRAPPERS] == ["DDP"]
