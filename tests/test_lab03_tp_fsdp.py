"""Lab 03, 2D TP + FSDP: parity for every mesh shape, resume across mesh shapes, collective
counts against the Megatron-LM analysis, the plan-key guard and bad inputs.

Each (dp, tp, sequence parallel) cell is launched once (module-scoped cache); several tests read
its metrics. Parity is checked in fp32, within 1e-5. It holds because the lab warms the learning
rate up from 0: without warmup, AdamW's first step turns TP's reordered fp32 sums into
parameter gaps of ~1e-4 (test_without_warmup_fp32_parity_fails_by_rounding shows the symptom and
that float64 removes it).
"""

import shutil

import pytest

from launcher import LABS, PYTHON, load_script, run_all, run_lab

LAB = "lab03_tp_fsdp"
STEPS, CHECKPOINT_EVERY = 6, 3
NUM_LAYERS = 2  # the lab's default --num-layers
CELLS = [(1, 2, False), (1, 2, True), (2, 2, False), (2, 2, True), (4, 1, False), (4, 1, True)]
SAVER = (2, 2, False)  # this cell also writes checkpoints for the resume tests
_launched = {}


def cell_id(cell):
    dp, tp, sp = cell
    return f"dp{dp}-tp{tp}-{'sp' if sp else 'nosp'}"


def launch(cell, tmp_path_factory):
    """Run one cell (once per module): parity, comm counts, and for SAVER checkpoints."""
    if cell not in _launched:
        dp, tp, sp = cell
        tmp = tmp_path_factory.mktemp(cell_id(cell))
        args = ["--tp", tp, "--steps", STEPS, "--check-parity", "--count-comms"]
        if sp:
            args += ["--sequence-parallel", "--loss-parallel"]
        if cell == SAVER:
            args += ["--checkpoint-dir", tmp / "ckpt", "--checkpoint-every", CHECKPOINT_EVERY]
        proc, metrics = run_lab(LAB, dp * tp, args, tmp, timeout=300)
        _launched[cell] = (proc, metrics, tmp)
    return _launched[cell]


def tp_ops(counts):
    """Collectives DTensor issued for TP (c10d_functional.*), not FSDP's (c10d.*)."""
    return {op.split(".")[-1]: n for op, n in counts.items() if op.startswith("c10d_functional.")}


@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_parity_with_single_process(cell, tmp_path_factory):
    proc, metrics, _ = launch(cell, tmp_path_factory)
    dp, tp, _ = cell
    print(f"\nparity {cell_id(cell)}: {metrics['parity_max_abs_diff']:.1e}")  # shown with -s
    assert metrics["mesh"] == [dp, tp]
    assert metrics["parity_max_abs_diff"] <= metrics["parity_tol"] == 1e-5
    assert len(metrics["reference_losses"]) == STEPS
    assert metrics["config"]["parity_dtype"] == "float32"
    for (_, loss), ref in zip(metrics["losses"], metrics["reference_losses"]):
        assert abs(loss - ref) <= 1e-5, (loss, ref)
    assert metrics["losses"][-1][1] < metrics["losses"][0][1]  # it learns
    assert proc.stdout.strip().splitlines()[-1].startswith(f"done | {LAB} | gloo x{dp * tp} |")


@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_each_rank_holds_its_slice(cell, tmp_path_factory):
    _, metrics, _ = launch(cell, tmp_path_factory)
    dp, tp, _ = cell
    dim, num_heads = metrics["config"]["dim"], metrics["config"]["num_heads"]
    assert metrics["wq_tp_local_width"] == dim // tp  # heads split by TP ...
    assert metrics["local_heads"] == num_heads // tp  # ... without touching module attributes
    per_rank = metrics["state_bytes_per_rank"]["params"]  # after the first step (labkit probe)
    # Every parameter is sharded over all dp x tp ranks (the sizes divide evenly here).
    world_total = sum(per_rank)
    assert all(abs(b - world_total / (dp * tp)) <= 0.01 * world_total for b in per_rank), per_rank


@pytest.mark.parametrize("cell", [c for c in CELLS if c[1] == 2], ids=cell_id)
def test_block_collectives_match_megatron(cell, tmp_path_factory):
    """Megatron-LM per block: without SP, one all-reduce after attention and one after the MLP
    in forward, and one before each in backward. With SP, each becomes an all-gather /
    reduce-scatter pair, plus one all-reduce per norm of its (partial) weight gradient."""
    _, metrics, _ = launch(cell, tmp_path_factory)
    block = metrics["comm_counts_block0"]
    print(f"\nblock 0 {cell_id(cell)}: {block}\nstep: {metrics['comm_counts_per_step']}")
    if cell[2]:
        assert tp_ops(block["forward"]) == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
        assert tp_ops(block["backward"]) == {"all_gather_into_tensor": 2,
                                             "reduce_scatter_tensor": 2, "all_reduce": 2}
    else:
        assert tp_ops(block["forward"]) == {"all_reduce": 2}
        assert tp_ops(block["backward"]) == {"all_reduce": 2}


@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_fsdp_collectives_per_step(cell, tmp_path_factory):
    """FSDP over dp: per unit (each block + the root) one all-gather in forward and one
    reduce-scatter in backward; blocks (resharded after forward) all-gather again in backward.
    With dp = 1 FSDP skips them; with tp = 1 DTensor has nothing to communicate."""
    _, metrics, _ = launch(cell, tmp_path_factory)
    dp, tp, _ = cell
    counts = metrics["comm_counts_per_step"]
    fsdp = {op: n for op, n in counts.items() if op.startswith("c10d.")}
    expected = {"c10d._allgather_base_": 2 * NUM_LAYERS + 1,
                "c10d._reduce_scatter_base_": NUM_LAYERS + 1} if dp > 1 else {}
    assert fsdp == expected
    if tp == 1:
        assert tp_ops(counts).keys() <= {"all_reduce"}  # only the grad-norm reduction over dp


@pytest.mark.parametrize("mesh", [(4, 1), (1, 2)], ids=["to-dp4-tp1", "to-dp1-tp2"])
def test_resume_on_another_mesh(mesh, tmp_path_factory):
    """A DCP checkpoint written on (2, 2) at step 3 resumes on another mesh; steps 4..6 repeat
    the uninterrupted run's losses, and the end state still matches the single-process run."""
    _, saver_metrics, saver_tmp = launch(SAVER, tmp_path_factory)
    dp, tp = mesh
    tmp = tmp_path_factory.mktemp(f"resume-dp{dp}-tp{tp}")
    shutil.copytree(saver_tmp / "ckpt", tmp / "ckpt")
    shutil.rmtree(tmp / "ckpt" / f"step_{STEPS:08d}")  # keep step 3 only
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == ["run.json",
                                                          f"step_{CHECKPOINT_EVERY:08d}"]
    proc, metrics = run_lab(LAB, dp * tp, ["--tp", tp, "--steps", STEPS, "--resume",
                                           "--checkpoint-dir", tmp / "ckpt", "--check-parity"],
                            tmp, timeout=300)
    assert f"at step {CHECKPOINT_EVERY}" in proc.stdout
    resumed = metrics["losses"]
    assert [s for s, _ in resumed] == list(range(CHECKPOINT_EVERY + 1, STEPS + 1))
    for (_, loss), (_, expected) in zip(resumed, saver_metrics["losses"][CHECKPOINT_EVERY:]):
        assert abs(loss - expected) <= 1e-6, (loss, expected)
    assert metrics["parity_max_abs_diff"] <= 1e-5


def test_without_warmup_fp32_parity_fails_by_rounding(tmp_path):
    """The symptom the warmup removes, and the proof that it is rounding: with --warmup-steps 0
    fp32 parameters end > 1e-5 apart while the losses agree; float64 agrees to ~1e-13."""
    no_warmup = ["--tp", 2, "--steps", 3, "--check-parity", "--parity-tol", 1e-2,
                 "--warmup-steps", 0]
    _, fp32 = run_lab(LAB, 2, no_warmup, tmp_path, timeout=300)
    _, fp64 = run_lab(LAB, 2, [*no_warmup, "--parity-dtype", "float64"], tmp_path,
                      timeout=300)
    print(f"\nno warmup: fp32 {fp32['parity_max_abs_diff']:.1e}, "
          f"float64 {fp64['parity_max_abs_diff']:.1e}")
    assert fp32["parity_max_abs_diff"] > 1e-5
    for (_, loss), ref in zip(fp32["losses"], fp32["reference_losses"]):
        assert abs(loss - ref) <= 1e-5, (loss, ref)
    assert fp64["parity_max_abs_diff"] < 1e-10


def test_learning_rate_warms_up_from_zero():
    """The kit's schedule (labkit/loop.py), through this lab's flags."""
    from labkit.loop import learning_rate

    cfg = load_lab().parse_config(["--tp", "1", "--lr", "1e-3", "--warmup-steps", "4"])
    assert [learning_rate(cfg, step) for step in range(1, 7)] == pytest.approx(
        [0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    cfg.warmup_steps = 0
    assert learning_rate(cfg, 1) == 1e-3


def load_lab():
    return load_script(LABS / f"{LAB}.py")


def test_plan_key_guard():
    lab = load_lab()
    from torch.distributed.tensor.parallel import ColwiseParallel

    cfg = lab.parse_config(["--tp", "1"])
    model = lab.build_model(cfg)
    block = model.layers["0"]
    for sp in (False, True):  # the lab's own plans name real modules
        cfg.sequence_parallel = cfg.loss_parallel = sp
        lab.check_plan_keys(block, lab.block_plan(cfg))
        lab.check_plan_keys(model, lab.root_plan(cfg))
    lab.check_plan_keys(model, {"layers.*.attention.wq": ColwiseParallel()})  # fnmatch keys
    with pytest.raises(ValueError, match="'attention.wqq'"):
        lab.check_plan_keys(block, {"attention.wq": ColwiseParallel(),
                                    "attention.wqq": ColwiseParallel()})
    with pytest.raises(ValueError, match="'attention.wq' matches no submodule of TinyLlama"):
        lab.check_plan_keys(model, {"attention.wq": ColwiseParallel()})  # a block key at the root


BAD_INPUTS = [
    ("1", ["--tp", "2"], "--tp: 2 does not divide the world size 1"),
    ("4", ["--tp", "3"], "--tp: 3 does not divide the world size 4"),
    ("4", ["--tp", "4", "--num-heads", "2"], "--tp: 4 does not divide --num-heads = 2"),
    ("2", ["--sequence-parallel", "--seq-len", "33"],
     "--tp: 2 does not divide --seq-len (with --sequence-parallel) = 33"),
    ("2", ["--tp", "-1"], "--tp: must be >= 0, got -1"),
    ("2", ["--warmup-steps", "-1"], "--warmup-steps: must be >= 0, got -1"),
    ("2", ["--parity-dtype", "float64"], "--parity-dtype: float64 applies to --check-parity only"),
]


@pytest.fixture(scope="module")
def refusals():
    """{(world size, args): the finished process} for every BAD_INPUTS case, side by side
    (launcher.run_all). Validation runs before any process group, so a plain process with
    WORLD_SIZE set sees exactly what every torchrun rank would."""
    procs = run_all([[PYTHON, str(LABS / f"{LAB}.py"), *args] for _, args, _ in BAD_INPUTS],
                    envs=[{"WORLD_SIZE": w, "LOCAL_WORLD_SIZE": w} for w, _, _ in BAD_INPUTS],
                    timeout=60)
    return {(w, tuple(args)): p for (w, args, _), p in zip(BAD_INPUTS, procs)}


@pytest.mark.parametrize("world_size,args,message", BAD_INPUTS,
                         ids=["plain-python-tp-2", "tp-3-of-4", "heads", "seq-len", "tp-negative",
                              "warmup", "float64-without-parity"])
def test_bad_input_is_one_line_and_exit_2(world_size, args, message, refusals):
    proc = refusals[(world_size, tuple(args))]
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_plain_python_world_of_one(tmp_path):
    proc, metrics = run_lab(LAB, 0, ["--tp", "1", "--steps", 3, "--check-parity"], tmp_path)
    assert metrics["world_size"] == 1 and metrics["mesh"] == [1, 1]
    assert metrics["parity_max_abs_diff"] <= 1e-5
    assert proc.stdout.strip().splitlines()[-1].startswith(f"done | {LAB} | gloo x1 |")
