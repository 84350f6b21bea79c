"""The Kubernetes recipes, checked without a cluster.

The primary recipe, launch/k8s/lab02-fsdp-trainjob.yaml (a Kubeflow Trainer v2 TrainJob on the
torch-distributed runtime), and the legacy one, launch/k8s/lab02-fsdp.yaml (a Training Operator
v1 PyTorchJob), are each checked four ways:

1. every document matches its published schema, strictly (tests/k8s_schema.py), and the
   checker does catch typos, wrong types and missing fields;
2. the controller's admission rules, and the recipe's own consistency rules, hold;
3. the environment the controller gives each pod, plus the container's command, makes
   torchrun's own parser produce the intended launch (2 nodes x 8 workers, the rendezvous on
   node 0, restarts); for the TrainJob, every variable torchrun takes from the environment is
   one the torch runtime sets, and the docs page shows what the manifest runs;
4. that command, with the controller's environment, runs as two "pods" on this machine and
   lab02 trains to the end (scaled down: 1 CPU worker per pod, a few steps, 127.0.0.1 for the
   rendezvous host, the repository's lab file for the ConfigMap's); the TrainJob's pods also
   lose a worker on the way and resume.

Not tested: a real cluster, the operator or the Trainer controller themselves, GPUs and NCCL.
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

MANIFEST = REPO / "launch" / "k8s" / "lab02-fsdp.yaml"  # legacy: PyTorchJob
TRAINJOB = REPO / "launch" / "k8s" / "lab02-fsdp-trainjob.yaml"  # primary: TrainJob
PAGE = REPO / "docs" / "reference" / "cluster-launch.md"


# ------------------------------------------ the legacy recipe: PyTorchJob (Training Operator v1)


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


def scaled_down(command, checkpoint_dir, *extra_args, replace=None):
    """The container's command for this machine: the repository's lab file, 4 steps, a
    checkpoint every 2 in checkpoint_dir; `replace` swaps more arguments."""
    replace = {"/course/labs/lab02_fsdp.py": str(LABS / "lab02_fsdp.py"),
               "--steps=2000": "--steps=4", "--checkpoint-every=100": "--checkpoint-every=2",
               "--checkpoint-dir=/checkpoints/lab02-fsdp": f"--checkpoint-dir={checkpoint_dir}",
               **(replace or {})}
    assert set(replace) <= set(command), command  # the recipe still has what we scale
    return [PYTHON, "-m", "torch.distributed.run",
            *[replace.get(arg, arg) for arg in command[1:]], *extra_args]


def test_two_pods_with_the_operators_environment_train(tmp_path):
    job = documents()["PyTorchJob"]
    env = {**quiet_env(), **pod_env(job), "OMP_NUM_THREADS": "1",
           "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}  # the service name of worker-0
    metrics = tmp_path / "metrics.json"
    command = scaled_down(container(job)["command"], tmp_path / "ckpt",
                          f"--metrics-out={metrics}",
                          replace={"--nproc-per-node=8": "--nproc-per-node=1"})
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


# ------------------------------------------------- the primary recipe: TrainJob (Trainer v2)
# What the Trainer v2 torch runtime does to each pod, read in Kubeflow Trainer v2.3.0, commit
# 658725bdae5c7e3a0854d93ac6ff492e109a22ab (the release of the kubeflow-trainer-api used here):
# pkg/runtime/framework/plugins/torch/torch.go: puts the 5 PET_* below in container "node"
# pkg/runtime/framework/plugins/torch/torch.go: keeps the command (it rewrites only `tune run`)
# pkg/runtime/framework/plugins/torch/torch.go: numNodes -> pod count; rejects PET_* in trainer.env
# pkg/constants/constants.go: the PET_* names, ContainerTrainerPort 29500, Node "node"
# manifests/base/runtimes/torch_distributed.yaml: replicated job "node", container "node"
# pkg/runtime/framework/plugins/jobset/builder.go: trainer image, command, env -> container "node"
# pkg/runtime/framework/plugins/jobset/jobset.go: pod count -> parallelism; runtimePatches rules
# pkg/runtime/core/trainingruntime.go: resourcesPerNode -> container "node"; patches merged in
# pkg/apis/trainer/v1alpha1/trainjob_types.go: metadata.name rules; runtimeRef defaults
# k8s.io/apimachinery v0.36.2 (ae3f98eb01e4), pkg/util/validation/validation.go: the manager rule
TORCH_PLUGIN_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                    "PET_MASTER_PORT")
TRAINER_PORT = 29500  # constants.ContainerTrainerPort
NODE = "node"  # the runtime's replicated job and its container


def trainjob_documents():
    return {doc["kind"]: doc for doc in yaml.safe_load_all(TRAINJOB.read_text())}


def pod_patch(job):
    """The recipe's patch of the runtime's pod template (replicated job "node")."""
    (patch,) = job["spec"]["runtimePatches"]
    (replicated_job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return replicated_job["template"]["spec"]["template"]["spec"]


def torch_plugin_env(job, node_rank):
    """The environment of container "node" in pod `node_rank` (torch.go, EnforceMLPolicy): the
    TrainJob's env, then the PET_* variables, which win."""
    trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
    plugin = {"PET_NNODES": str(trainer.get("numNodes", 1)),  # the runtime's mlPolicy: 1
              # "auto" with GPUs in resourcesPerNode (without: their CPU count)
              "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
              "PET_NODE_RANK": str(node_rank),  # the pod's Job completion index
              "PET_MASTER_ADDR": f"{name}-{NODE}-0-0.{name}",  # pod 0 of job 0, headless service
              "PET_MASTER_PORT": str(TRAINER_PORT)}
    assert tuple(plugin) == TORCH_PLUGIN_ENV
    return {**{e["name"]: e["value"] for e in trainer.get("env", [])}, **plugin}


def documented_launch():
    """The page's block of what each pod gets and runs: ({rank: {PET_*: value}}, command)."""
    text = PAGE.read_text()
    pods = {int(rank): dict(pair.split("=", 1) for pair in line.split())
            for rank, line in re.findall(r"^pod (\d+): +(.+)$", text, re.M)}
    (command,) = re.findall(r"^both: +(.+)$", text, re.M)
    return pods, command.split()


@pytest.mark.parametrize("kind", ["PersistentVolumeClaim", "TrainJob"])
def test_trainjob_matches_the_published_models(kind):
    """kubeflow-trainer-api's models, strictly: no unknown field, no wrong type, nothing
    missing; and their own deserializer gives the document back whole."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    document = trainjob_documents()[kind]
    assert k8s_schema.errors(document) == []
    if kind == "TrainJob":
        assert (document["apiVersion"], document["kind"]) == (
            "trainer.kubeflow.org/v1alpha1", "TrainJob")
        assert TrainerV1alpha1TrainJob.from_dict(document).to_dict() == document


def misspelt_field(job):
    job["spec"]["trainer"]["numNode"] = job["spec"]["trainer"].pop("numNodes")


def image_in_a_container_patch(job):
    pod_patch(job)["containers"][0]["image"] = "pytorch/pytorch:latest"


def int_trainer_env_value(job):
    job["spec"]["trainer"]["env"][0]["value"] = 8


def string_num_nodes(job):
    job["spec"]["trainer"]["numNodes"] = "2"


def no_runtime_name(job):
    del job["spec"]["runtimeRef"]["name"]


def list_quantity(job):
    job["spec"]["trainer"]["resourcesPerNode"]["limits"]["cpu"] = [64]


TRAINJOB_BREAKAGES = [
    (misspelt_field, "TrainJob.spec.trainer.numNode: unknown field of TrainerV1alpha1Trainer"),
    (image_in_a_container_patch,  # a runtime patch may not change the image
     "containers[0].image: unknown field of TrainerV1alpha1ContainerPatch"),
    (int_trainer_env_value, "trainer.env[0].value: Input should be a valid string, got int 8"),
    (string_num_nodes, "trainer.numNodes: Input should be a valid integer, got str '2'"),
    (no_runtime_name, "runtimeRef: missing required field `name`"),
    (list_quantity, "limits.cpu: expected one of ['float', 'str']"),
]


@pytest.mark.parametrize("breakage,message", TRAINJOB_BREAKAGES,
                         ids=[b.__name__ for b, _ in TRAINJOB_BREAKAGES])
def test_the_checker_catches_a_broken_trainjob(breakage, message):
    job = copy.deepcopy(trainjob_documents()["TrainJob"])
    breakage(job)
    found = k8s_schema.errors(job)
    assert any(message in line for line in found), found


def test_trainer_admission_rules_hold():
    """Restated from the sources above: an RFC 1035 name of at most 63 characters; a runtime
    the torch runtime's group and kind name; no reserved PET_* in spec.trainer.env; runtime
    patches owned by a domain-prefixed manager, one entry each, naming only the runtime's
    replicated job and container, with no env for container "node"."""
    job = trainjob_documents()["TrainJob"]
    name = job["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org",
                                         "kind": "ClusterTrainingRuntime",
                                         "name": "torch-distributed"}
    assert not {e["name"] for e in job["spec"]["trainer"]["env"]} & set(TORCH_PLUGIN_ENV)
    managers = [patch["manager"] for patch in job["spec"]["runtimePatches"]]
    assert len(managers) == len(set(managers))
    label = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
    for manager in managers:
        host, _, path = manager.partition("/")
        assert re.fullmatch(rf"{label}(\.{label})*", host) and len(host) <= 253, manager
        assert re.fullmatch(r"[A-Za-z0-9/\-._~%!$&'()*+,;=:]+", path), manager
    for patch in job["spec"]["runtimePatches"]:
        for replicated_job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            assert replicated_job["name"] == NODE
            for box in replicated_job["template"]["spec"]["template"]["spec"]["containers"]:
                assert box["name"] == NODE and "env" not in box


def test_trainjob_recipe_is_consistent():
    """The legacy recipe's lab, flags and image; one worker per GPU; a thread share per
    worker; the lab file where the ConfigMap is mounted; checkpoints on the shared claim; a
    memory-backed /dev/shm."""
    docs = trainjob_documents()
    job, claim = docs["TrainJob"], docs["PersistentVolumeClaim"]
    trainer, legacy = job["spec"]["trainer"], container(documents()["PyTorchJob"])
    command = trainer["command"]
    assert command[0] == "torchrun" and command[2:] == legacy["command"][2:]
    assert trainer["image"] == legacy["image"]
    limits = trainer["resourcesPerNode"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == trainer["numProcPerNode"]
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert int(env["OMP_NUM_THREADS"]) * trainer["numProcPerNode"] == int(limits["cpu"])
    spec = pod_patch(job)
    volumes = {v["name"]: v for v in spec["volumes"]}
    (box,) = spec["containers"]
    mounts = {m["mountPath"]: volumes[m["name"]] for m in box["volumeMounts"]}
    script = PurePosixPath(command[2])
    assert mounts[str(script.parent)]["configMap"]["name"] == "course-labs"
    assert (LABS / script.name).is_file()
    checkpoint_dir = PurePosixPath(next(a.split("=", 1)[1] for a in command
                                        if a.startswith("--checkpoint-dir=")))
    shared = next(v for path, v in mounts.items() if checkpoint_dir.is_relative_to(path))
    assert shared["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # both pods write shards
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"


def test_the_page_shows_what_the_trainjob_runs():
    """docs/reference/cluster-launch.md states each pod's PET_* variables and the command;
    they are the manifest's, and its "2 pods x 8 GPUs" is numNodes x numProcPerNode."""
    job = trainjob_documents()["TrainJob"]
    trainer = job["spec"]["trainer"]
    pods, command = documented_launch()
    assert command == trainer["command"]
    assert sorted(pods) == list(range(trainer["numNodes"]))
    for rank, env in pods.items():
        plugin = torch_plugin_env(job, rank)
        assert env == {name: plugin[name] for name in TORCH_PLUGIN_ENV}
    nodes, nproc = trainer["numNodes"], trainer["numProcPerNode"]
    section = PAGE.read_text().split("\n## Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    assert f"{nodes} pods x {nproc} GPUs" in section
    assert (nodes, nproc) == (2, 8)  # --hsdp=2 across pods, and lab02 is checked at 16 ranks


def test_trainjob_relies_only_on_variables_the_torch_runtime_sets():
    """torchrun reads PET_<FLAG> for every flag not on its command line; the ones a pod has
    are exactly the plugin's, and the recipe sets none of its own (nor refers to others)."""
    from torch.distributed.argparse_util import check_env, env
    from torch.distributed.run import get_args_parser

    job = trainjob_documents()["TrainJob"]
    pod = torch_plugin_env(job, node_rank=1)
    readable = {f"PET_{action.dest.upper()}" for action in get_args_parser()._actions
                if isinstance(action, (env, check_env))}
    assert readable & set(pod) == set(TORCH_PLUGIN_ENV)
    assert {name for name in pod if name.startswith("PET_")} == set(TORCH_PLUGIN_ENV)
    command = " ".join(job["spec"]["trainer"]["command"])
    assert set(re.findall(r"\$\((\w+)\)", command)) <= set(pod)  # Kubernetes' $(VAR)


def test_each_trainjob_pod_launches_the_intended_job(monkeypatch):
    """The plugin's environment and the command, through torchrun's own parser: a static
    rendezvous on pod 0 at the runtime's port, 2 nodes x 8 workers, 3 restarts, the agents
    waiting 900 s for each other."""
    from torch.distributed.run import config_from_args, get_args_parser

    job = trainjob_documents()["TrainJob"]
    command = job["spec"]["trainer"]["command"]
    assert command[0] == "torchrun"  # the runtime starts the command as it is
    for name in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(name)
    for node_rank in range(job["spec"]["trainer"]["numNodes"]):
        for name, value in torch_plugin_env(job, node_rank).items():
            monkeypatch.setenv(name, value)
        args = get_args_parser().parse_args(command[1:])  # reads PET_* as it is built
        config, _, _ = config_from_args(args)
        assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 8)
        assert config.rdzv_backend == "static" and config.rdzv_configs["rank"] == node_rank
        assert config.rdzv_endpoint == f"lab02-fsdp-node-0-0.lab02-fsdp:{TRAINER_PORT}"
        assert config.max_restarts == 3 and config.rdzv_configs["timeout"] == 900
        assert args.training_script == "/course/labs/lab02_fsdp.py"
    lab = load_script(LABS / "lab02_fsdp.py")
    monkeypatch.setenv("WORLD_SIZE", "16")  # what each worker will see: 2 pods x 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = lab.parse_config(args.training_script_args)  # the lab's own checks, at 16 ranks
    assert (cfg.hsdp, cfg.checkpoint_dir) == (2, "/checkpoints/lab02-fsdp")


def test_two_trainjob_pods_train_through_a_worker_failure(tmp_path):
    """Each pod's agent with the plugin's environment (static rendezvous), scaled down. Rank 1,
    alone in pod 1, dies at step 3 on the first attempt: its agent restarts it, pod 0's agent
    restarts rank 0 once its collective fails, and both resume from step 2's checkpoint."""
    job = trainjob_documents()["TrainJob"]
    port = str(free_port())
    command = scaled_down(job["spec"]["trainer"]["command"], tmp_path / "ckpt",
                          "--fail-at-step=3", "--fail-rank=1")
    pods = []
    for node_rank in range(2):
        env = {**quiet_env(), **torch_plugin_env(job, node_rank), "OMP_NUM_THREADS": "1",
               "PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "127.0.0.1",  # pod 0's address
               "PET_MASTER_PORT": port}
        pods.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=tmp_path))
    try:
        outputs = [pod.communicate(timeout=240)[0] for pod in pods]
    finally:
        for pod in pods:
            pod.kill()
    assert [pod.returncode for pod in pods] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "injected failure: rank 1 exits at step 3" in outputs[1], outputs[1][-3000:]
    assert f"resumed from {tmp_path / 'ckpt' / 'step_00000002'} at step 2" in outputs[0], outputs[0]
    assert "done | lab02_fsdp | gloo x2 | 4 steps" in outputs[0], outputs[0][-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == [
        "step_00000002", "step_00000004"]
