"""Grade a port of capstone/train_plain.py: run it at 2 ranks, run the original in one
process, and compare. One line per check, then the verdict; exit 0 only if every check passes.

    python capstone/grade.py my_port.py            # torchrun --nproc-per-node 2 my_port.py ...

The checks (docs/onboarding.md, "Capstone"):
  1. clean exit: status 0 within --timeout-s, and no rank left its process group alive;
  2. outputs: losses.json and a checkpoint, either checkpoint.pt (a state_dict saved by rank 0)
     or a DCP directory checkpoint/ (dcp.save from every rank);
  3. parameters: the checkpoint's weights equal the single-process run's within --tol; a port
     whose weights never changed, or that repeats epoch 0's order, is named as such;
  4. losses: every step's logged loss equals the single-process loss of the same global batch.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_plain  # noqa: E402

LEFT_ALIVE = "destroy_process_group() was not called"


def run_port(port, out, timeout_s):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(port), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {timeout_s:.0f} s (a hang?)"
    return proc, None


def load_checkpoint(out):
    """The port's final weights as a plain state_dict, or (None, why)."""
    if (out / "checkpoint.pt").exists():
        return torch.load(out / "checkpoint.pt", weights_only=True), None
    if (out / "checkpoint" / ".metadata").exists():
        state = train_plain.build_model().state_dict()
        dcp.load(state, checkpoint_id=out / "checkpoint")  # no process group: one reader
        return state, None
    return None, "no checkpoint.pt and no DCP checkpoint/ directory in --out"


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def check_parameters(state, args, tol):
    """(passed, message). The diagnosis of a miss compares with two wrong references."""
    reference = train_plain.train(args)[1].state_dict()
    if set(state) != set(reference):
        return False, f"checkpoint keys {sorted(state)[:3]}... are not the model's (a 'module.' prefix?)"
    diff = max_diff(state, reference)
    if diff <= tol:
        return True, f"max |param diff| {diff:.1e} <= {tol:.0e}"
    torch.manual_seed(args.seed)
    if max_diff(state, train_plain.build_model().state_dict()) == 0:
        return False, ("the weights never changed: was the optimizer built before fully_shard "
                       "(it then steps the old, replaced parameters)?")
    repeated = train_plain.train(args, reshuffle=False)[1].state_dict()
    if max_diff(state, repeated) <= tol:
        return False, ("every epoch saw epoch 0's order: call sampler.set_epoch(epoch) before "
                       "each epoch")
    return False, f"max |param diff| {diff:.1e} > {tol:.0e}"


def check_losses(losses, reference, tol, trained_right):
    if len(losses) != len(reference):
        return False, f"{len(losses)} logged steps, the original runs {len(reference)}"
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    if diff <= tol:
        return True, f"max |loss diff| {diff:.1e} <= {tol:.0e}"
    if not trained_right:
        return False, f"max |loss diff| {diff:.1e}: fix the parameters first"
    return False, (f"max |loss diff| {diff:.1e} with the right weights: the logged loss is one "
                   "rank's; log the mean over ranks (all_reduce with ReduceOp.AVG)")


def grade(port, out, tol, timeout_s):
    """[(check, passed, message)]."""
    args = train_plain.parse_args(["--out", str(out)])
    proc, problem = run_port(port, out, timeout_s)
    if proc is None:
        return [("clean exit", False, problem)]
    tail = (proc.stderr or "").strip().splitlines()[-1:] or ["(no output)"]
    clean = proc.returncode == 0 and LEFT_ALIVE not in proc.stderr
    results = [("clean exit", clean, "exit 0, process groups destroyed" if clean else
                f"exit {proc.returncode}: {tail[0]}" if proc.returncode else
                "a rank exited without destroy_process_group()")]
    state, why = load_checkpoint(out)
    losses_path = out / "losses.json"
    if state is None or not losses_path.exists():
        return results + [("outputs", False, why or "no losses.json in --out")]
    results.append(("outputs", True, "losses.json and the checkpoint"))
    params_ok, message = check_parameters(state, args, tol)
    results.append(("parameters", params_ok, message))
    reference_losses = train_plain.train(args)[0]
    results.append(("losses", *check_losses(json.loads(losses_path.read_text()),
                                            reference_losses, tol, params_ok)))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", help="your port of capstone/train_plain.py")
    parser.add_argument("--tol", type=float, default=1e-5, help="max |difference| allowed")
    parser.add_argument("--timeout-s", type=float, default=180, help="limit for the 2-rank run")
    args = parser.parse_args(argv)
    if not Path(args.port).is_file():
        print(f"grade.py: error: no such file: {args.port}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        results = grade(Path(args.port).resolve(), Path(folder) / "out", args.tol, args.timeout_s)
    for check, passed, message in results:
        print(f"{'PASS' if passed else 'FAIL'}  {check:<11} {message}")
    passed = all(ok for _, ok, _ in results) and len(results) == 4
    print(f"verdict: {'PASS' if passed else 'FAIL'} ({Path(args.port).name})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
