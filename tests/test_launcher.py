"""The test launcher itself (tests/launcher.py): a launch that overruns its timeout leaves no
process behind, and says where every rank was."""

import re
import textwrap
from pathlib import Path

import pytest

from launcher import LaunchError, run, torchrun_cmd

HANGING_SCRIPT = textwrap.dedent("""\
    import os, time

    def wait_for_a_peer_that_never_comes():
        while True:
            time.sleep(0.1)

    print(f"worker {os.getpid()} waiting", flush=True)
    wait_for_a_peer_that_never_comes()
    """)


def alive(pid):
    """Running, not a zombie waiting for its parent to read its status."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_torchrun_launch_that_times_out_leaves_no_worker_and_shows_their_stacks(tmp_path):
    """torchrun starts each worker in a session of its own, so killing the agent alone left
    the workers running, holding ports and CPU, and the timeout said nothing of where they
    were."""
    script = tmp_path / "hang.py"
    script.write_text(HANGING_SCRIPT)
    with pytest.raises(LaunchError) as failure:
        run(torchrun_cmd(script, 2), timeout=20)
    message = str(failure.value)
    # Both workers write to torchrun's one stdout: their lines may run together.
    workers = [int(pid) for pid in re.findall(r"worker (\d+) waiting", message)]
    assert len(workers) == 2, message
    assert message.count("wait_for_a_peer_that_never_comes") >= 2, message  # both stacks
    assert not [pid for pid in workers if alive(pid)]
