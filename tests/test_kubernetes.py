"""The Kubernetes recipe, launch/k8s/lab02-fsdp.yaml (a Kubeflow PyTorchJob), checked without a
cluster:

1. every document matches its published schema, strictly (tests/k8s_schema.py), and the
   checker does catch typos, wrong types and missing fields;
2. the Training Operator's admission rules, and the recipe's own consistency rules, hold;
3. the environment the operator gives each pod, plus the container's command, makes torchrun's
   own parser produce the intended launch (2 nodes x 8 workers, c10d on worker-0, restarts);
4. that command, with the operator's environment, runs as two "pods" on this machine and lab02
   trains to the end (scaled down: 1 CPU worker per pod, a few steps, 127.0.0.1 for the
   rendezvous host, the repository's lab file for the ConfigMap's).

Not tested: a real cluster, the operator itself, GPUs and NCCL.
"""

import copy
import os
import re
import subprocess
from pathlib import PurePosixPath

import pytest
import yaml

import k8s_schema
from launcher import LABS, PYTHON, REPO, free_port, load_script, quiet_env

MANIFEST = REPO / "launch" / "k8s" / "lab02-fsdp.yaml"


def documents():
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def worker(job):
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]


def container(job):
    return worker(job)["template"]["spec"]["containers"][0]


def operator_env(job):
    """What the Training Operator (v1.8/1.9) adds to a Worker-only elastic job's containers,
    restated from pkg/controller.v1/pytorch/envvar.go and elastic.go."""
    policy = job["spec"]["elasticPolicy"]
    port = policy.get("rdzvPort") or next(
        p["containerPort"] for p in container(job)["ports"] if p["name"] == "pytorchjob-port")
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    env = {"PYTHONUNBUFFERED": "0", "PET_RDZV_ENDPOINT": f"{host}:{port}",
           "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
           "PET_NNODES": (f"{policy['minReplicas']}:{policy['maxReplicas']}"
                          if "minReplicas" in policy or "maxReplicas" in policy
                          else str(worker(job)["replicas"]))}
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    return env


def pod_env(job):
    return {**{e["name"]: e["value"] for e in container(job).get("env", [])}, **operator_env(job)}


@pytest.mark.parametrize("kind", ["PersistentVolumeClaim", "PyTorchJob"])
def test_manifest_matches_the_published_schemas(kind):
    assert k8s_schema.errors(documents()[kind]) == []


def break_field(job):
    job["spec"]["pytorchReplicaSpec"] = job["spec"].pop("pytorchReplicaSpecs")


def int_env_value(job):
    container(job)["env"][0]["value"] = 8


def no_container_name(job):
    del container(job)["name"]


def string_replicas(job):
    worker(job)["replicas"] = "2"


BREAKAGES = [
    (break_field, "PyTorchJob.spec.pytorchReplicaSpec: unknown field"),
    (int_env_value, "containers[0].env[0].value: expected str, got int 8"),
    (no_container_name, "containers[0]: Invalid value for `name`, must not be `None`"),
    (string_replicas, "Worker.replicas: expected int, got str '2'"),
]


@pytest.mark.parametrize("breakage,message", BREAKAGES, ids=[b.__name__ for b, _ in BREAKAGES])
def test_the_checker_catches_a_broken_manifest(breakage, message):
    job = copy.deepcopy(documents()["PyTorchJob"])
    breakage(job)
    found = k8s_schema.errors(job)
    assert any(message in line for line in found), found


def test_operator_admission_rules_hold():
    """pkg/webhooks/pytorch/pytorchjob_webhook.go and webhooks/utils: a DNS-1035 name; Workers
    when an elastic policy is set; a container named "pytorch" in every replica, every
    container with an image; a Master, if any, exactly 1; not both nprocPerNode fields. And
    envvar.go needs the port named "pytorchjob-port" to build the rendezvous endpoint when
    rdzvPort is not set."""
    job = documents()["PyTorchJob"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", job["metadata"]["name"])
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) <= {"Master", "Worker"} and "Worker" in specs
    assert specs.get("Master", {"replicas": 1})["replicas"] == 1
    for spec in specs.values():
        assert any(c["name"] == "pytorch" for c in spec["template"]["spec"]["containers"])
        assert all(c.get("image") for c in spec["template"]["spec"]["containers"])
        assert spec["replicas"] >= 1
    assert not ("nprocPerNode" in job["spec"] and "nProcPerNode" in job["spec"]["elasticPolicy"])
    assert any(p["name"] == "pytorchjob-port" for p in container(job)["ports"])


def test_recipe_is_consistent():
    """Fixed world size (exact resume needs it), one worker per GPU, a thread share per worker,
    the lab file where the ConfigMap is mounted, checkpoints on the shared claim."""
    docs = documents()
    job, claim = docs["PyTorchJob"], docs["PersistentVolumeClaim"]
    policy, box = job["spec"]["elasticPolicy"], container(job)
    assert policy["minReplicas"] == policy["maxReplicas"] == worker(job)["replicas"]
    nproc = int(next(a for a in box["command"] if a.startswith("--nproc-per-node=")).split("=")[1])
    limits = box["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == nproc
    assert int(pod_env(job)["OMP_NUM_THREADS"]) * nproc == int(limits["cpu"])
    volumes = {v["name"]: v for v in worker(job)["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in box["volumeMounts"]}
    script = PurePosixPath(box["command"][2])
    assert mounts[str(script.parent)]["configMap"]["name"] == "course-labs"
    assert (LABS / script.name).is_file()
    checkpoint_dir = PurePosixPath(next(a.split("=", 1)[1] for a in box["command"]
                                        if a.startswith("--checkpoint-dir=")))
    shared = next(v for path, v in mounts.items() if checkpoint_dir.is_relative_to(path))
    assert shared["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # both pods write shards
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"


def test_each_pod_launches_the_intended_job(monkeypatch):
    """torchrun reads PET_<FLAG> variables as defaults for its flags; its own parser and
    config_from_args show what each pod's agent will do."""
    from torch.distributed.run import config_from_args, get_args_parser

    job = documents()["PyTorchJob"]
    for name in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(name)
    for name, value in pod_env(job).items():
        monkeypatch.setenv(name, value)
    command = container(job)["command"]
    assert command[0] == "torchrun"
    args = get_args_parser().parse_args(command[1:])
    config, _, _ = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 8)
    assert config.rdzv_backend == "c10d"
    assert config.rdzv_endpoint == "lab02-fsdp-worker-0:29400"
    assert config.run_id == "lab02-fsdp" and config.max_restarts == 3
    assert args.training_script == "/course/labs/lab02_fsdp.py"
    lab = load_script(LABS / "lab02_fsdp.py")
    monkeypatch.setenv("WORLD_SIZE", "16")  # what each worker will see: 2 pods x 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = lab.parse_config(args.training_script_args)  # the lab's own checks accept these flags at 16 ranks
    assert (cfg.hsdp, cfg.checkpoint_dir) == (2, "/checkpoints/lab02-fsdp")


def scaled_down(command, checkpoint_dir, metrics):
    """The container's command for this machine: 1 CPU worker per pod, 4 steps."""
    replace = {"--nproc-per-node=8": "--nproc-per-node=1",
               "/course/labs/lab02_fsdp.py": str(LABS / "lab02_fsdp.py"),
               "--steps=2000": "--steps=4", "--checkpoint-every=100": "--checkpoint-every=2",
               "--checkpoint-dir=/checkpoints/lab02-fsdp": f"--checkpoint-dir={checkpoint_dir}"}
    assert set(replace) <= set(command), command  # the recipe still has what we scale
    return [PYTHON, "-m", "torch.distributed.run",
            *[replace.get(arg, arg) for arg in command[1:]], f"--metrics-out={metrics}"]


def test_two_pods_with_the_operators_environment_train(tmp_path):
    job = documents()["PyTorchJob"]
    env = {**quiet_env(), **pod_env(job), "OMP_NUM_THREADS": "1",
           "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}  # the service name of worker-0
    metrics = tmp_path / "metrics.json"
    command = scaled_down(container(job)["command"], tmp_path / "ckpt", metrics)
    pods = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env, cwd=tmp_path) for _ in range(2)]
    try:
        outputs = [pod.communicate(timeout=240)[0] for pod in pods]
    finally:
        for pod in pods:
            pod.kill()
    assert [pod.returncode for pod in pods] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert any("done | lab02_fsdp | gloo x2 | 4 steps" in out for out in outputs), outputs
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == [
        "step_00000002", "step_00000004"]
