"""The capstone grader (capstone/grade.py) passes the course's reference ports, DDP and FSDP2,
and fails the three typical wrong ports, each with its own diagnosis."""

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


def grade(port):
    proc = subprocess.run([PYTHON, str(REPO / "capstone" / "grade.py"), str(port)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    return proc.returncode, proc.stdout


@pytest.mark.parametrize("port", ["port_ddp.py", "port_fsdp2.py"])
def test_the_reference_ports_pass(port):
    returncode, out = grade(REPO / "tests" / "capstone" / port)
    assert returncode == 0, out
    assert sum(line.startswith("PASS  ") for line in out.splitlines()) == 4, out
    assert "verdict: PASS" in out


def grade_edited(tmp_path, edits):
    """Grade the reference port with `edits` applied: (exit status, output)."""
    source = REFERENCE.read_text()
    for old, new in edits:
        assert old in source, old  # the edit still applies to the reference
        source = source.replace(old, new)
    # Next to the reference, so its import of capstone/train_plain.py resolves the same way.
    port = REFERENCE.with_name(f"_wrong_{tmp_path.name}.py")
    port.write_text(source)
    try:
        return grade(port)
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
