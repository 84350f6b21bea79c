"""The capstone grader (capstone/grade.py) passes the course's reference ports, DDP and FSDP2,
and fails the three typical wrong ports, each with its own diagnosis."""

import json
import subprocess
from pathlib import Path

import pytest

from launcher import PYTHON, REPO

REFERENCE = REPO / "tests" / "capstone" / "port_fsdp2.py"
WRONG_PORTS = {
    # The optimizer holds the parameters fully_shard is about to replace: it steps nothing.
    "optimizer before fully_shard": (
        [("    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after fully_shard\n", ""),
         ("    model = build_model()\n", "    model = build_model()\n"
          "    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)\n")],
        "parameters", "the weights never changed"),
    "set_epoch missing": (
        [("        sampler.set_epoch(epoch)\n", "")],
        "parameters", "call sampler.set_epoch(epoch)"),
    "loss not averaged over ranks": (
        [("            dist.all_reduce(logged, op=dist.ReduceOp.AVG)  # the global batch's mean\n", "")],
        "losses", "the logged loss is one rank's"),
}


def grade(port, final=False):
    """capstone/grade.py on `port` (with --final, the final capstone): (exit status, output)."""
    proc = subprocess.run([PYTHON, str(REPO / "capstone" / "grade.py"),
                           *(["--final"] if final else []), str(port)],
                          capture_output=True, text=True, timeout=600 if final else 300, cwd=REPO)
    return proc.returncode, proc.stdout


@pytest.mark.parametrize("port", ["port_ddp.py", "port_fsdp2.py"])
def test_the_reference_ports_pass(port):
    returncode, out = grade(REPO / "tests" / "capstone" / port)
    assert returncode == 0, out
    assert sum(line.startswith("PASS  ") for line in out.splitlines()) == 4, out
    assert "verdict: PASS" in out


def grade_edited(tmp_path, edits, reference=REFERENCE, final=False):
    """Grade a reference port with `edits` applied: (exit status, output)."""
    source = reference.read_text()
    for old, new in edits:
        assert old in source, old  # the edit still applies to the reference
        source = source.replace(old, new)
    # Next to the reference, so its import of the capstone's script resolves the same way.
    port = reference.with_name(f"_wrong_{tmp_path.name}.py")
    port.write_text(source)
    try:
        return grade(port, final)
    finally:
        port.unlink()


@pytest.mark.parametrize("name", list(WRONG_PORTS))
def test_a_typical_wrong_port_fails_with_its_diagnosis(name, tmp_path):
    edits, check, diagnosis = WRONG_PORTS[name]
    returncode, out = grade_edited(tmp_path, edits)
    assert returncode == 1, out
    line = next(l for l in out.splitlines() if l.split()[1:2] == [check])
    assert line.startswith("FAIL") and diagnosis in line, out
    assert "verdict: FAIL" in out


def test_a_dcp_checkpoint_is_accepted(tmp_path):
    """Rank 0's torch.save or a DCP directory from every rank: the grader reads both."""
    edits = [("    options = StateDictOptions(full_state_dict=True, cpu_offload=True)\n"
              "    state = get_model_state_dict(model, options=options)  # a collective: every rank\n",
              "    import torch.distributed.checkpoint as dcp\n"
              "    dcp.save(get_model_state_dict(model), checkpoint_id=Path(args.out) / \"checkpoint\")\n"),
             ("        torch.save(state, out / \"checkpoint.pt\")\n", "")]
    returncode, out = grade_edited(tmp_path, edits)
    assert returncode == 0, out


def test_a_missing_port_is_one_line_and_exit_2():
    proc = subprocess.run([PYTHON, str(REPO / "capstone" / "grade.py"), "nope.py"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip() == "grade.py: error: no such file: nope.py"


# The final capstone: capstone/train_transformer.py on a 2 x 2 (dp, tp) mesh, stopped and resumed.
REFERENCE_2D = REPO / "tests" / "capstone" / "port_2d.py"
WRONG_2D_PORTS = {
    # Only the model is saved and loaded: the resumed leg starts AdamW's moments from zero.
    "optimizer state not saved": (
        [('    dcp.save({"model": model_state, "optim": optim_state, "step": step}, checkpoint_id=tmp)\n',
          '    dcp.save({"model": model_state, "step": step}, checkpoint_id=tmp)\n'),
         ('    state = {"model": model_state, "optim": optim_state, "step": 0}\n',
          '    state = {"model": model_state, "step": 0}\n'),
         ('    set_state_dict(model, optimizer, model_state_dict=state["model"],\n'
          '                   optim_state_dict=state["optim"])\n',
          '    dcp.state_dict.set_model_state_dict(model, state["model"])\n')],
        "checkpoint", "no optimizer state"),
    # Sliced by the global rank, the two tp ranks of a replica compute on different sequences.
    "batch split by the global rank": (
        [("global_batch(dataset, step, args.batch_size, args.seed).chunk(dp_size)[dp_rank]",
          "global_batch(dataset, step, args.batch_size, args.seed).chunk(world_size)[rank]")],
        "parameters", "the batch split by the dp rank"),
    # FSDP alone: the weights are split over dp only.
    "no tensor parallel": (
        [("        parallelize_module(block, mesh[\"tp\"], {", "        dict({"),
         ("        block.attention.num_heads //= TP  # each rank computes its share of the heads\n", "")],
        "layout", "saved in 2 piece(s), not 4"),
    # The resumed leg starts a new list: the first leg's losses are gone.
    "losses not kept across the restart": (
        [("    losses = read_losses(out, done)\n", "    losses = []\n")],
        "resumed leg", "losses.json holds 6 steps after the resume"),
}


def test_the_reference_2d_port_passes_the_final_capstone():
    returncode, out = grade(REFERENCE_2D, final=True)
    assert returncode == 0, out
    assert sum(line.startswith("PASS  ") for line in out.splitlines()) == 6, out
    assert "verdict: PASS" in out


@pytest.mark.parametrize("name", list(WRONG_2D_PORTS))
def test_a_typical_wrong_2d_port_fails_with_its_diagnosis(name, tmp_path):
    edits, check, diagnosis = WRONG_2D_PORTS[name]
    returncode, out = grade_edited(tmp_path, edits, REFERENCE_2D, final=True)
    assert returncode == 1, out
    line = next(l for l in out.splitlines() if l[6:].startswith(check))
    assert line.startswith("FAIL") and diagnosis in line, out
    assert "verdict: FAIL" in out


def test_the_plain_transformer_resumes_exactly(tmp_path):
    """The starting point keeps its own contract: stopped at 6 and resumed, it trains what one
    uninterrupted run trains, to the bit."""
    script = REPO / "capstone" / "train_transformer.py"
    run = lambda out, *extra: subprocess.run([PYTHON, str(script), "--out", str(out), *extra],
                                            check=True, capture_output=True, timeout=120)
    run(tmp_path / "straight")
    run(tmp_path / "resumed", "--stop-at-step", "6")
    assert len(json.loads((tmp_path / "resumed" / "losses.json").read_text())) == 6
    run(tmp_path / "resumed")
    straight, resumed = (json.loads((tmp_path / name / "losses.json").read_text())
                         for name in ("straight", "resumed"))
    assert len(straight) == 12 and resumed == straight
