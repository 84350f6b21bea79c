"""lab02 (FSDP2) under torchrun on gloo: parity with one process (FSDP and HSDP, world sizes
2 and 4), resume at another world size, consolidated export, memory measured per rank against
DDP and against labs/memory_estimator.py, bad inputs, --compile.

Each launch costs seconds, so every fixture is one launch that several tests read, and every
launch turns on more than one feature (each feature is then covered by a parity check).
"""

import importlib.util
import json
import shutil

import pytest
import torch

from launcher import LABS, PYTHON, run, run_all, run_lab

LAB = "lab02_fsdp"
STEPS = 12
TOL = 0.05  # the bound: measured within 5%


def load(name):
    spec = importlib.util.spec_from_file_location(name, LABS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lab = load(LAB)  # nothing runs at import: only its helpers are used here
est = load("memory_estimator")


def launch(tmp_path_factory, name, nproc, args, timeout=300):
    tmp = tmp_path_factory.mktemp(name)
    proc, metrics = run_lab(LAB, nproc, [*args], tmp, timeout=timeout)
    return {"proc": proc, "metrics": metrics, "tmp": tmp}


@pytest.fixture(scope="module")
def fsdp4(tmp_path_factory):
    export = tmp_path_factory.mktemp("fsdp4_export") / "model.pt"
    result = launch(tmp_path_factory, "fsdp4", 4, ["--steps", STEPS, "--check-parity",
                                                     "--export", export])
    return {**result, "export": export}


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    # Accumulation (set_requires_gradient_sync) and the ZeRO-2-like mode, under parity.
    return launch(tmp_path_factory, "fsdp2", 2, ["--steps", STEPS, "--check-parity",
                                                   "--grad-accum", 2,
                                                   "--reshard-after-forward", "false"])


@pytest.fixture(scope="module")
def hsdp4(tmp_path_factory):
    return launch(tmp_path_factory, "hsdp4", 4, ["--steps", STEPS, "--check-parity",
                                                   "--hsdp", 2, "--activation-checkpointing"])


@pytest.fixture(scope="module")
def hsdp2(tmp_path_factory):
    return launch(tmp_path_factory, "hsdp2", 2, ["--steps", STEPS, "--check-parity",
                                                   "--hsdp", 2, "--cpu-offload"])


@pytest.fixture(scope="module")
def memory_runs(tmp_path_factory, fsdp2, fsdp4):
    """Per-rank state at world sizes 1, 2, 4 for DDP and FSDP (world 1: plain python)."""
    short = ["--steps", 2]
    runs = {("fsdp", 2): fsdp2["metrics"], ("fsdp", 4): fsdp4["metrics"]}
    # World of one, from a copy of the lab and its kit alone in a directory: stdlib + torch.
    alone = tmp_path_factory.mktemp("alone")
    shutil.copy(LABS / f"{LAB}.py", alone)
    shutil.copytree(LABS / "labkit", alone / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    run([PYTHON, f"{LAB}.py", *map(str, short), "--metrics-out", "m.json"], cwd=alone)
    runs[("fsdp", 1)] = json.loads((alone / "m.json").read_text())
    for nproc in (0, 2, 4):
        metrics = launch(tmp_path_factory, f"ddp{nproc}", nproc, [*short, "--strategy", "ddp"])
        runs[("ddp", max(nproc, 1))] = metrics["metrics"]
    runs[("zero1", 2)] = launch(tmp_path_factory, "zero1", 2, [
        "--steps", 4, "--strategy", "zero1", "--check-parity"])["metrics"]
    return runs


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """World size 4 checkpoints at step 3, then rank 0 dies while step 6's checkpoint is being
    committed (every shard and .metadata on disk, not yet renamed). World size 2 resumes: it
    must ignore step_00000006.tmp (and a directory without .metadata), load step 3, reshard
    it, and finish the run."""
    tmp = tmp_path_factory.mktemp("resume")
    ckpt = tmp / "ckpt"
    common = ["--steps", STEPS, "--checkpoint-dir", ckpt, "--checkpoint-every", 3]
    crashed, _ = run_lab(LAB, 4, [*common, "--crash-in-checkpoint", 6], tmp, timeout=300,
                         check=False)
    left_behind = sorted(p.name for p in ckpt.iterdir())
    (ckpt / "step_00000010").mkdir()  # a directory DCP never finished: no .metadata
    second = launch(tmp_path_factory, "resume_b", 2, [*common, "--resume",
                                                       "--export", tmp / "model.pt"])
    return {"crashed": crashed, "left_behind": left_behind, "second": second, "ckpt": ckpt,
            "export": tmp / "model.pt"}


def state_total(metrics, rank):
    b = metrics["state_bytes_per_rank"]
    return b["params"][rank] + b["grads"][rank] + b["optimizer"][rank]


def max_total(metrics):
    return max(state_total(metrics, r) for r in range(metrics["world_size"]))


@pytest.mark.parametrize("run_name", ["fsdp2", "fsdp4", "hsdp2", "hsdp4"])
def test_parity_with_single_process(run_name, request):
    metrics = request.getfixturevalue(run_name)["metrics"]
    assert metrics["world_size"] == int(run_name[-1])
    assert metrics["parity_max_abs_diff"] <= metrics["parity_tol"] == 1e-5
    assert len(metrics["reference_losses"]) == STEPS
    losses = [loss for _, loss in metrics["losses"]]
    assert losses[-1] < 0.7 * losses[0], "the loss should visibly fall"


def test_layout_fsdp_and_hsdp(fsdp4, hsdp4):
    for metrics, mesh, placements, shards in [
            (fsdp4["metrics"], {"dp": 4}, "(Shard(dim=0),)", 4),
            (hsdp4["metrics"], {"dp_replicate": 2, "dp_shard": 2},
             "(Replicate(), Shard(dim=0))", 2)]:
        assert metrics["mesh"] == mesh
        assert set(metrics["layout"]) == set(metrics["param_shapes"])
        for name, (placement, shape, local_shapes) in metrics["layout"].items():
            assert placement == placements, name
            assert local_shapes == [[shape[0] // shards, *shape[1:]]] * 4, name


def test_fsdp_state_is_ddp_state_over_world_size(memory_runs):
    ddp_per_rank = max_total(memory_runs[("ddp", 1)])
    for world_size in (1, 2, 4):
        ddp = memory_runs[("ddp", world_size)]
        fsdp = memory_runs[("fsdp", world_size)]
        assert max_total(ddp) == pytest.approx(ddp_per_rank, rel=TOL)  # DDP never shrinks
        assert max_total(fsdp) == pytest.approx(max_total(ddp) / world_size, rel=TOL)


def test_estimator_predicts_what_ranks_hold(memory_runs):
    for (strategy, world_size), metrics in memory_runs.items():
        shapes = list(metrics["param_shapes"].values())
        e = est.estimate_per_rank(None, world_size, "zero3" if strategy == "fsdp" else strategy,
                                  shapes=shapes)
        b = metrics["state_bytes_per_rank"]
        for part, predicted in [("params", e.params_bytes), ("grads", e.grads_bytes),
                                ("optimizer", e.optimizer_bytes)]:
            assert max(b[part]) == pytest.approx(predicted, rel=TOL), (strategy, world_size, part)
        assert max_total(metrics) == pytest.approx(e.total_bytes, rel=TOL)


def test_the_plan_predicts_the_state_ranks_hold(memory_runs, monkeypatch):
    """--plan's params, grads and AdamW state per rank (labkit/plan.py), against the bytes the
    ranks held after a step, for DDP, ZeRO-1 and FSDP at each world size."""
    from labkit import plan

    for (strategy, world_size), metrics in memory_runs.items():
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))
        cfg = lab.parse_config(["--strategy", strategy])
        items = plan.estimate_memory(cfg, lab.plan_layout(cfg, world_size), None)
        held = metrics["state_bytes_per_rank"]
        for part, item in [("params", "params (fp32)"), ("grads", "grads (fp32)"),
                           ("optimizer", "AdamW state (2 x fp32)")]:
            assert max(held[part]) == pytest.approx(items[item], rel=TOL), (strategy, part)


def test_zero_stages_side_by_side(memory_runs, fsdp2, fsdp4):
    ddp, zero1 = memory_runs[("ddp", 2)], memory_runs[("zero1", 2)]
    full = 4 * ddp["num_params"]
    assert zero1["parity_max_abs_diff"] <= 1e-5
    # Stage 1: optimizer state split, params and grads still whole.
    assert max(zero1["state_bytes_per_rank"]["optimizer"]) == pytest.approx(
        max(ddp["state_bytes_per_rank"]["optimizer"]) / 2, rel=TOL)
    assert zero1["state_bytes_per_rank"]["params"] == [full, full]
    # Stage 2-like vs 3: same state between steps, different params held into backward.
    no_reshard, zero3 = fsdp2["metrics"], fsdp4["metrics"]
    assert no_reshard["unsharded_param_bytes_after_forward"] == [full, full]
    shapes = zero3["param_shapes"]
    root_only = 4 * sum(torch.Size(shape).numel() for name, shape in shapes.items()
                        if not name.startswith("layers."))
    assert zero3["unsharded_param_bytes_after_forward"] == [root_only] * 4
    assert ddp["unsharded_param_bytes_after_forward"] == [full, full]


def test_resume_at_another_world_size_continues_the_run(resumed, fsdp4):
    crashed, second = resumed["crashed"], resumed["second"]
    assert crashed.returncode != 0
    assert "injected crash while writing the checkpoint of step 6" in crashed.stderr
    assert resumed["left_behind"] == ["run.json", "step_00000003", "step_00000006.tmp"]
    # The resume at 2 ranks keeps the global batch of the run at 4 (run.json), not 8 x 2.
    assert "step_00000003 at step 3 (96 samples seen)" in second["proc"].stdout
    uninterrupted = dict(map(tuple, fsdp4["metrics"]["losses"]))
    after = dict(map(tuple, second["metrics"]["losses"]))
    assert sorted(after) == list(range(4, STEPS + 1))
    assert max(abs(after[s] - uninterrupted[s]) for s in after) <= 1e-6
    names = sorted(p.name for p in resumed["ckpt"].iterdir())
    assert names == ["run.json", "step_00000009", "step_00000010", f"step_{STEPS:08d}"]
    assert lab.latest_checkpoint(resumed["ckpt"]).name == f"step_{STEPS:08d}"
    # The byte probes measure the resumed run's first real step, not the state-creating
    # optimizer step that loading a checkpoint takes (get_state_dict on an empty optimizer).
    probed = second["metrics"]
    assert all(probed["unsharded_param_bytes_after_forward"]), probed
    assert all(v for per_rank in probed["state_bytes_per_rank"].values() for v in per_rank)


def test_consolidated_export_loads_in_one_process(resumed, fsdp4):
    cfg = lab.parse_config([])
    model = lab.build_model(cfg)
    state = torch.load(resumed["export"], map_location="cpu", weights_only=True)
    model.load_state_dict(state)  # strict: same names, plain tensors, no DTensor
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in state.values())
    other = torch.load(fsdp4["export"], weights_only=True)
    assert max((state[k] - other[k]).abs().max().item() for k in state) <= 1e-5
    with torch.no_grad():
        tokens = torch.arange(cfg.seq_len).remainder(cfg.vocab_size)[None]
        assert torch.isfinite(model(tokens)).all()


def test_latest_checkpoint_ignores_incomplete(tmp_path):
    assert lab.latest_checkpoint(tmp_path) is None
    for name, complete in [("step_00000002", True), ("step_00000004.tmp", True),
                           ("step_00000005", False)]:
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / ".metadata").write_bytes(b"")
    assert lab.latest_checkpoint(tmp_path).name == "step_00000002"


def test_no_torchrun_runs_as_world_of_one(memory_runs):
    metrics = memory_runs[("fsdp", 1)]
    assert (metrics["world_size"], metrics["backend"], metrics["mesh"]) == (1, "gloo", {"dp": 1})


def test_compile_with_bf16_mixed_precision(tmp_path):
    """One short run: per-block torch.compile (aot_eager: dynamo + AOTAutograd without C++
    code generation, which takes minutes on a 2-core box) under bf16 MixedPrecisionPolicy."""
    proc, metrics = run_lab(LAB, 2, ["--steps", 4, "--compile", "--compile-backend", "aot_eager",
                                     "--mixed-precision", "bf16"], tmp_path, timeout=400)
    assert metrics["config"]["compile"] and metrics["steps"] == 4
    losses = [loss for _, loss in metrics["losses"]]
    assert losses[-1] < losses[0]
    # The root's gathered params are bf16 now: 2 bytes per element, not 4.
    root = sum(torch.Size(s).numel() for n, s in metrics["param_shapes"].items()
               if not n.startswith("layers."))
    assert metrics["unsharded_param_bytes_after_forward"] == [2 * root, 2 * root]
    assert metrics["first_step_s"] > 0 and proc.stdout.strip().splitlines()[-1].startswith("done")


BAD_INPUTS = [
    (["--hsdp", "3"], 4, "--hsdp"),
    (["--mixed-precision", "fp8"], 2, "--mixed-precision"),
    (["--strategy", "ddp", "--mixed-precision", "fp16"], 2, "--mixed-precision"),
    (["--strategy", "ddp", "--cpu-offload"], 2, "--cpu-offload"),
    (["--check-parity", "--mixed-precision", "bf16"], 2, "--check-parity"),
]


@pytest.fixture(scope="module")
def refusals():
    """{(args, world size): the finished process} for every BAD_INPUTS case, each a plain
    process that believes it is one of a job of that size, side by side (launcher.run_all)."""
    procs = run_all([[PYTHON, str(LABS / f"{LAB}.py"), *args] for args, _, _ in BAD_INPUTS],
                    envs=[{"WORLD_SIZE": str(w)} for _, w, _ in BAD_INPUTS], timeout=120)
    return {(tuple(args), w): p for (args, w, _), p in zip(BAD_INPUTS, procs)}


@pytest.mark.parametrize("args, world_size, flag", BAD_INPUTS)
def test_bad_input_is_one_clear_line(args, world_size, flag, refusals):
    proc = refusals[(tuple(args), world_size)]
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for nccl")
def test_nccl_parity_and_bf16_on_gpus(tmp_path):
    _, metrics = run_lab(LAB, 2, ["--steps", STEPS, "--check-parity", "--amp", "off"], tmp_path)
    assert metrics["backend"] == "nccl" and metrics["parity_max_abs_diff"] <= 1e-5
    _, metrics = run_lab(LAB, 2, ["--steps", STEPS, "--mixed-precision", "bf16"], tmp_path)
    assert metrics["peak_mem_kind"] == "cuda_max_allocated"
    assert metrics["unsharded_param_bytes_after_forward"][0] > 0


def test_profile_dir_writes_a_trace_per_rank_with_the_collectives_and_the_matmuls(tmp_path):
    """--profile-dir: steps 3 and 4 of each rank, in the Chrome trace format that Perfetto and
    chrome://tracing open. FSDP2's collectives are all in it: per step, an all-gather per unit
    in forward (two blocks and the root) and per block again in backward (the root stays
    gathered), and a reduce-scatter per unit. gloo runs them on its own threads, apart from
    the training thread's matmuls."""
    from collections import Counter

    run_lab(LAB, 2, ["--steps", 6, "--profile-dir", tmp_path / "trace"], tmp_path)
    for rank in (0, 1):
        trace = json.loads((tmp_path / "trace" / f"rank{rank}.json").read_text())
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        names = Counter(e["name"] for e in events)
        assert names["ProfilerStep#2"] == names["ProfilerStep#3"] == 1, names  # steps 3, 4
        assert names["gloo:all_gather"] == 2 * (3 + 2)
        assert names["c10d::_reduce_scatter_base_"] == 2 * 3
        assert names["aten::mm"] > 0
        threads = {kind: {e["tid"] for e in events if e["name"].startswith(kind)}
                   for kind in ("gloo:", "aten::mm")}
        assert threads["gloo:"] and threads["gloo:"].isdisjoint(threads["aten::mm"])
