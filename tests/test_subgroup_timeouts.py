"""--timeout-s bounds every wait, sub-groups included (runbooks/collective-timeout.md, cause D).

torch 2.13's init_device_mesh gives every axis smaller than the world the backend's default
timeout (30 min on gloo), not init_process_group's. The drill shows both meshes; the lab tests
stall one rank of a 2-D mesh and demand that the job ends, with gloo's timeout error, within
the timeout plus a margin. Before the fix the same runs exited 0 after the stall (the
sub-group simply waited it out).
"""

import subprocess
import time

import pytest

from launcher import LABS, REPO, quiet_env, run, torchrun_cmd

DRILL = REPO / "runbooks" / "drills" / "hang_subgroup.py"
TIMEOUT_S = 5
MARGIN_S = 20  # process start-up is not in it: the clock starts at the "injected stall" line


def drill(mesh):
    return run(torchrun_cmd(DRILL, 4, ["--mesh", mesh, "--timeout-s", 3, "--stall-s", 10]),
               timeout=120, check=False)


def test_init_device_mesh_axes_keep_the_30_minute_default():
    proc = drill("init_device_mesh")
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: default group 0:00:03 | axis dp 0:30:00 | axis tp 0:30:00" in proc.stdout
    # The stalled peer's tp partner waited the whole stall out, far past --timeout-s 3.
    waited = [line for line in proc.stdout.splitlines() if line.startswith("rank 0: all_reduce")]
    assert len(waited) == 1 and "returned after" in waited[0]
    assert float(waited[0].split("after ")[1].split(" s")[0]) >= 9.0


def test_axes_built_with_the_timeout_fail_after_it_naming_the_axis():
    proc = drill("with-timeout")
    assert proc.returncode != 0
    assert "rank 0: default group 0:00:03 | axis dp 0:00:03 | axis tp 0:00:03" in proc.stdout
    failed = [line for line in proc.stdout.splitlines() if line.startswith("rank 0: all_reduce")]
    assert len(failed) == 1, proc.stdout
    assert "on mesh axis 'tp' (ranks [0, 1]) failed after 3." in failed[0]
    assert "Timed out waiting 3000ms for recv operation to complete" in failed[0]


def run_until_exit(cmd, start_marker, timeout=240):
    """Run cmd; return (exit code, output, seconds from the line containing start_marker to
    the exit)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=quiet_env(), cwd=REPO)
    lines, started = [], None
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if started is None and start_marker in line:
            started = time.monotonic()
        if time.monotonic() > deadline:
            proc.kill()
            break
    proc.wait(timeout=60)
    assert started is not None, "".join(lines)
    return proc.returncode, "".join(lines), time.monotonic() - started


# Each layout stalls rank 1, which shares a sub-group (not only the world) with the others.
STALLED_LAYOUTS = {
    "lab02_fsdp": ["--hsdp", "2"],          # (dp_replicate, dp_shard) = (2, 2)
    "lab03_tp_fsdp": ["--tp", "2"],         # (dp, tp) = (2, 2)
    "lab04_pipeline": ["--dp", "2"],        # (dp, pp) = (2, 2)
    "lab05_3d": ["--pp", "1", "--dp", "2", "--tp", "2"],  # (pp, dp, tp) = (1, 2, 2)
    "lab07_context_parallel": ["--cp", "2"],  # (dp, cp) = (2, 2): the ring's p2p on cp
    "lab08_expert_parallel": ["--ep", "2"],   # (dp, ep) = (2, 2): the all-to-alls on ep
}


@pytest.mark.parametrize("lab", STALLED_LAYOUTS)
def test_a_stalled_rank_on_a_2d_mesh_ends_the_job_within_the_timeout(lab):
    args = [*STALLED_LAYOUTS[lab], "--steps", "6", "--stall-at-step", "3", "--fail-rank", "1",
            "--timeout-s", TIMEOUT_S]
    code, out, seconds = run_until_exit(torchrun_cmd(LABS / f"{lab}.py", 4, args),
                                        "injected stall: rank 1")
    assert code != 0, out  # before the fix: exit 0, once the stall (10 x timeout) was over
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in out, out
    assert seconds < TIMEOUT_S + MARGIN_S, f"ended {seconds:.1f} s after the stall\n{out}"
