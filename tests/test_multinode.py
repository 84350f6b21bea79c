"""Two nodes on one machine: two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1)
reach exactly the result of one agent with the same world size; agents that disagree on
--rdzv-id never meet and fail with a rendezvous timeout; the SLURM recipe, run with stand-in
srun/scontrol commands, starts the same two agents and trains; two agents in two Linux network
namespaces (a veth pair, real addresses, no shared loopback) match one agent too, and each of
the three launch settings a node with a loopback hostname needs shows its own symptom when
left out (runbooks/drills/two_node_netns.sh).

The SLURM test does not run a real SLURM controller: `srun` and `scontrol` are small shell
stand-ins (below) that start the script's per-node command once per node on this machine.
"""

import json
import os
import re
import shutil
import socket
import stat
import subprocess

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from launcher import LABS, PYTHON, REPO, free_port, quiet_env, run_lab

SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
NETNS_DRILL = REPO / "runbooks" / "drills" / "two_node_netns.sh"
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


@pytest.mark.parametrize("script", [SBATCH, NETNS_DRILL], ids=lambda p: p.name)
def test_shell_scripts_pass_shellcheck(script):
    proc = subprocess.run(["shellcheck", "--severity=style", str(script)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def netns_unavailable():
    """Why this machine cannot run the network-namespace drill ('' when it can)."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return "needs root and iproute2 (ip netns)"
    probe = f"cnprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return ""


def start_netns_drill(omit, log_dir, timeout_s, lab_args):
    log_dir.mkdir(parents=True)
    env = {**quiet_env(), "PYTHON": PYTHON, "LOG_DIR": str(log_dir), "TIMEOUT_S": str(timeout_s),
           "LAB_ARGS": lab_args}
    return subprocess.Popen(["bash", str(NETNS_DRILL), "--omit", omit], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)


NETNS_UNAVAILABLE = netns_unavailable()
needs_netns = pytest.mark.skipif(bool(NETNS_UNAVAILABLE), reason=NETNS_UNAVAILABLE or "-")


@needs_netns
def test_two_network_namespaces_match_one_agent(tmp_path):
    """Two nodes with their own addresses on a veth link (10.77.0.1, 10.77.0.2): with
    is_host, --local-addr and GLOO_SOCKET_IFNAME set, lab01 trains exactly as one agent does."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = [*STEPS, "--checkpoint-every", "6"]
    run_lab("lab01_ddp", 2, [*common, "--checkpoint-dir", one], timeout=300)
    drill = start_netns_drill("none", tmp_path / "logs", 30,
                              " ".join([*common, "--checkpoint-dir", str(two)]))
    out, _ = drill.communicate(timeout=300)
    assert drill.returncode == 0, out[-3000:]
    assert "two_node_netns: OK" in out and "done | lab01_ddp | gloo x2 | 6 steps" in out, out
    a, b = final_state("lab01_ddp", one, tmp_path), final_state("lab01_ddp", two, tmp_path)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


# What each omitted setting prints (TIMEOUT_S=5), as runbooks/startup-hang.md (cause E) quotes it.
NETNS_SYMPTOMS = {
    # Nobody hosts the store: the endpoint is not what the host node's hostname resolves to.
    "is-host": ["RendezvousConnectionError: The connection to the C10d store has failed. "
                "See inner exception for details.",
                "while trying to connect to (10.77.0.1, 29400)"],
    # Node B's worker is sent to node A's hostname, which resolves to B's own loopback.
    "local-addr": ["The client socket has timed out after 5000ms while trying to connect to (",
                   "DistStoreError: wait timeout"],
    # gloo binds what the hostname resolves to (127.0.1.1), and tells the peer to come there.
    "gloo-ifname": ["Gloo connectFullMesh failed with", "Connection refused, remote=[127.0.1.1]:"],
}


@needs_netns
def test_each_omitted_setting_shows_its_symptom(tmp_path):
    page = (REPO / "runbooks" / "startup-hang.md").read_text()
    drills = {omit: start_netns_drill(omit, tmp_path / omit, 5, "--steps 4")
              for omit in NETNS_SYMPTOMS}  # side by side: they mostly wait for timeouts
    for omit, drill in drills.items():
        out, _ = drill.communicate(timeout=300)
        logs = out + "".join(p.read_text() for p in (tmp_path / omit).glob("node*.log"))
        assert drill.returncode == 1, out[-3000:]
        assert f"two_node_netns: FAILED | exit codes 1 1 | omitted: {omit}" in out, out[-3000:]
        assert "step " not in logs  # no rank ever trained
        for symptom in NETNS_SYMPTOMS[omit]:
            assert symptom in logs, (omit, symptom, out[-3000:])
            assert symptom in page, f"startup-hang.md does not quote {symptom!r}"
        if omit == "local-addr":  # the name it was sent to: this machine's hostname
            assert f"while trying to connect to ({socket.gethostname()}, " in logs


def test_netns_drill_refuses_bad_input():
    proc = subprocess.run(["bash", str(NETNS_DRILL), "--omit", "dns"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "--omit: unknown setting 'dns' (is-host, local-addr, gloo-ifname)"



def test_slurm_recipe_survives_a_long_node_list(tmp_path):
    """`scontrol ... | head -n 1` under pipefail ends the script with 141 (SIGPIPE) once the
    node list outgrows the pipe buffer; the recipe reads the first node without closing early."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\nfor i in $(seq 100000); do echo "gpu-$i"; done\n')
    (bin_dir / "scontrol").chmod(stat.S_IRWXU)
    env = {k: v for k, v in os.environ.items() if k != "HEAD_NODE"}
    env.update({"PATH": f"{bin_dir}:{os.environ['PATH']}", "DRY_RUN": "1", "SLURM_JOB_ID": "7",
                "SLURM_NNODES": "100000", "SLURM_JOB_NODELIST": "gpu-[1-100000]",
                "SLURM_GPUS_ON_NODE": "8"})
    proc = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert "--rdzv-endpoint gpu-1:29400" in proc.stdout
