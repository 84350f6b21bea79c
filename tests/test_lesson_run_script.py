"""lessons/spawn.py's run_script, which lesson 06 starts its labs with: each rank gets
torchrun's environment and runs the script as __main__; a failing rank stops the launch with
every rank's output; a hang ends at the timeout, naming the script."""

import sys
import time

import pytest

from launcher import REPO

sys.path.insert(0, str(REPO / "lessons"))
from spawn import run_script  # noqa: E402

SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
      f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} args {sys.argv[1:]} "
      f"main {__name__} extra {os.environ.get('EXTRA')}", flush=True)
print("UserWarning: printed after the summary line", file=sys.stderr, flush=True)
if "--fail" in sys.argv and rank == 1:
    sys.exit("rank 1: bad shard")
if "--hang" in sys.argv:
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("run_script") / "probe.py"
    path.write_text(SCRIPT)
    run_script(path, 1, timeout_s=300)  # the fork server starts here, not inside a timed test
    return path


def test_each_rank_gets_torchruns_environment(script):
    out = run_script(script, 2, ["--x", 1], timeout_s=60, env={"EXTRA": "set"})
    assert out.startswith("rank 0 of 2 local 0 master 127.0.0.1:")
    assert "args ['--x', '1'] main __main__ extra set" in out
    assert "UserWarning" not in out  # stdout only: a caller prints its last line, the summary


def test_a_failing_rank_raises_with_every_ranks_output(script):
    with pytest.raises(RuntimeError) as error:
        run_script(script, 2, ["--fail"], timeout_s=60)
    text = str(error.value)
    assert "probe.py --fail" in text and "exit code 1" in text
    assert "--- rank 1 stderr\nUserWarning" in text and "rank 1: bad shard" in text
    assert "--- rank 0 stdout\nrank 0 of 2" in text


def test_a_hang_ends_at_the_timeout(script):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"probe.py on 2 ranks did not finish within 3 s"):
        run_script(script, 2, ["--hang"], timeout_s=3)
    assert time.monotonic() - start < 20
