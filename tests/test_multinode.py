"""Two nodes on one machine: two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1)
reach exactly the result of one agent with the same world size; agents that disagree on
--rdzv-id never meet and fail with a rendezvous timeout; the SLURM recipe, run with stand-in
srun/scontrol commands, starts the same two agents and trains.

The SLURM test does not run a real SLURM controller: `srun` and `scontrol` are small shell
stand-ins (below) that start the script's per-node command once per node on this machine.
"""

import json
import os
import re
import stat
import subprocess

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from launcher import LABS, PYTHON, REPO, free_port, quiet_env, run_lab

SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
STEPS = ["--steps", "6"]


def agent_cmd(lab, port, rdzv_id, lab_args, join_timeout=60):
    return [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", rdzv_id, "--rdzv-conf", f"join_timeout={join_timeout}",
            str(LABS / f"{lab}.py"), *map(str, lab_args)]


def run_agents(cmds, timeout=300):
    """Start every agent at once (as every node would), wait for all; [(rc, out), ...]."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=quiet_env(), cwd=REPO) for cmd in cmds]
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            proc.kill()
    return results


def final_state(lab, checkpoint_dir, tmp_path):
    newest = sorted(p for p in checkpoint_dir.glob("step_*") if p.suffix != ".tmp")[-1]
    if lab == "lab01_ddp":
        return torch.load(newest, weights_only=True)["model"]
    target = tmp_path / f"{checkpoint_dir.name}.pt"
    dcp_to_torch_save(newest, target)
    return torch.load(target, weights_only=False)["model"]  # just written by dcp_to_torch_save


@pytest.mark.parametrize("lab", ["lab01_ddp", "lab02_fsdp"])
def test_two_agents_match_one_agent(lab, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    common = [*STEPS, "--checkpoint-every", "6"]
    run_lab(lab, 2, [*common, "--checkpoint-dir", one, "--metrics-out", one / "m.json"],
            timeout=300)
    args = [*common, "--checkpoint-dir", two, "--metrics-out", two / "m.json"]
    port = free_port()
    results = run_agents([agent_cmd(lab, port, "two-nodes", args) for _ in range(2)])
    for rc, out in results:
        assert rc == 0, out[-3000:]
    assert sum(f"done | {lab} | gloo x2" in out for _, out in results) == 1  # rank 0's agent
    one_metrics = json.loads((one / "m.json").read_text())
    two_metrics = json.loads((two / "m.json").read_text())
    assert two_metrics["world_size"] == 2
    assert two_metrics["losses"] == one_metrics["losses"]  # every logged loss, exactly
    a, b = final_state(lab, one, tmp_path), final_state(lab, two, tmp_path)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_agents_with_different_rdzv_ids_never_meet(tmp_path):
    """docs/reference/launching.md: --rdzv-id must be identical on every node."""
    port = free_port()
    cmds = [agent_cmd("lab01_ddp", port, rdzv_id, STEPS, join_timeout=8)
            for rdzv_id in ("job-17", "job-18")]
    results = run_agents(cmds, timeout=180)
    for rc, out in results:
        assert rc != 0, out
        assert "step " not in out  # no worker ever started training
    # The agent that hosts the store times out waiting for a second node of its job and exits;
    # the other one either times out too or loses the store it was waiting on.
    pattern = r"rendezvous\.api\.(RendezvousTimeoutError|RendezvousConnectionError)\b"
    errors = sorted((re.findall(pattern, out) or ["no rendezvous error"])[-1]
                    for _, out in results)
    assert errors[-1] == "RendezvousTimeoutError", errors


STAND_INS = {
    # Prints one host per node of the allocation: both "nodes" are this machine.
    "scontrol": '#!/bin/bash\n[[ $1 == show && $2 == hostnames ]] || exit 2\n'
                'for _ in $(seq "$SLURM_NNODES"); do echo 127.0.0.1; done\n',
    # Runs the per-node command once per node, side by side, with the node's SLURM variables.
    "srun": '#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\npids=()\n'
            'for node in $(seq 0 $((SLURM_NNODES - 1))); do\n'
            '  SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "logs/node$node.out" 2>&1 &\n'
            '  pids+=($!)\ndone\nrc=0\nfor pid in "${pids[@]}"; do wait "$pid" || rc=1; done\n'
            'cat logs/node*.out\nexit $rc\n',
}


def test_slurm_recipe_starts_one_agent_per_node_and_trains(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STAND_INS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    # torchrun itself comes from the test environment's interpreter.
    (bin_dir / "torchrun").write_text(f'#!/bin/bash\nexec {PYTHON} -m torch.distributed.run "$@"\n')
    (bin_dir / "torchrun").chmod(stat.S_IRWXU)
    metrics = tmp_path / "m.json"
    env = {**quiet_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_CPUS_PER_TASK": "1",
           "PROCS_PER_NODE": "1", "RDZV_PORT": str(free_port()), "MAX_RESTARTS": "0",
           "LAB": str(LABS / "lab01_ddp.py"), "LAB_ARGS": f"--steps 4 --metrics-out {metrics}"}
    proc = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done | lab01_ddp | gloo x2 | 4 steps" in proc.stdout
    assert json.loads(metrics.read_text())["world_size"] == 2


@pytest.mark.parametrize("lab", sorted(p.name for p in LABS.glob("lab0*.py")))
def test_slurm_dry_run_prints_each_nodes_command(lab):
    env = {**os.environ, "DRY_RUN": "1", "HEAD_NODE": "gpu-a01", "SLURM_JOB_ID": "991",
           "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "gpu-a[01-04]",
           "SLURM_CPUS_PER_TASK": "64", "SLURM_GPUS_ON_NODE": "8", "LAB": f"labs/{lab}"}
    proc = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "OMP_NUM_THREADS=8",
        "on each of 4 nodes: torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d "
        f"--rdzv-endpoint gpu-a01:29400 --rdzv-id 991 --max-restarts 3 labs/{lab}"]


def test_slurm_recipe_refuses_to_run_outside_a_job():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=30)
    assert proc.returncode != 0
    assert "run this with sbatch" in proc.stderr


def test_slurm_recipe_passes_shellcheck():
    proc = subprocess.run(["shellcheck", "--severity=style", str(SBATCH)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
