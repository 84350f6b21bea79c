"""Grade a capstone port: run it under torchrun, run the original in one process, compare.
One line per check, then the verdict; exit 0 only if every check passes.

    python capstone/grade.py my_port.py            # mid-course: train_plain.py on 2 ranks
    python capstone/grade.py --final my_port.py    # final: train_transformer.py, 2-D, resumed

Mid-course (docs/onboarding.md, "Capstone"), a port of capstone/train_plain.py to DDP or FSDP2:
  1. clean exit: status 0 within --timeout-s, and no rank left its process group alive;
  2. outputs: losses.json and a checkpoint, either checkpoint.pt (a state_dict saved by rank 0)
     or a DCP directory checkpoint/ (dcp.save from every rank);
  3. parameters: the checkpoint's weights equal the single-process run's within --tol; a port
     whose weights never changed, or that repeats epoch 0's order, is named as such;
  4. losses: every step's logged loss equals the single-process loss of the same global batch.

Final (--final), a port of capstone/train_transformer.py to a 2 x 2 (dp, tp) mesh on 4 ranks,
run twice: stopped after step STOP, then resumed to the last step:
  1. first leg: a clean exit, as above;
  2. layout: the checkpoint splits each attention and MLP weight 4 ways (dp x tp);
  3. checkpoint: it loads into the one-process model and optimizer, with AdamW's state for
     every parameter and the step it was saved after;
  4. resumed leg: a clean exit, and losses.json covers every step;
  5. parameters: the final weights equal the uninterrupted single-process run's within --tol;
  6. losses: every step's logged loss equals the single-process loss.
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
from torch.distributed.checkpoint import FileSystemReader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_plain  # noqa: E402
import train_transformer as lm  # noqa: E402

LEFT_ALIVE = "destroy_process_group() was not called"
FINAL_RANKS, FINAL_STOP = 4, 6  # a 2 x 2 (dp, tp) mesh; the first leg stops after step 6
# The weights tensor parallel splits: each must be saved in dp x tp = 4 pieces.
TP_WEIGHTS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
              "feed_forward.w2")


def run_port(port, out, timeout_s, nproc=2, extra_args=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(port), "--out", str(out), *extra_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {timeout_s:.0f} s (a hang?)"
    return proc, None


def clean_exit(proc, problem):
    """(passed, message) for one launch from run_port."""
    if proc is None:
        return False, problem
    if proc.returncode:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["(no output)"]
        return False, f"exit {proc.returncode}: {tail[0]}"
    if LEFT_ALIVE in proc.stderr:
        return False, "a rank exited without destroy_process_group()"
    return True, "exit 0, process groups destroyed"


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
    results = [("clean exit", *clean_exit(proc, problem))]
    if proc is None:
        return results
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


# The final capstone: train_transformer.py on a (dp, tp) mesh, stopped and resumed.
def run_lm(args):
    """The uninterrupted one-process run of train_transformer.py: (losses, model)."""
    model = lm.build_model(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset, losses = lm.make_dataset(args.seed), []
    for step in range(1, args.steps + 1):
        tokens = lm.global_batch(dataset, step, args.batch_size, args.seed)
        losses.append(lm.train_step(model, optimizer, tokens, lm.lr_at(step, args)).item())
    return losses, model


def check_layout(checkpoint):
    """(passed, message): in how many pieces the first block's TP-split weights were saved."""
    if not (checkpoint / ".metadata").exists():
        return False, "no DCP checkpoint/ directory in --out after the first leg"
    saved = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    pieces = {}
    for name in TP_WEIGHTS:
        entry = saved.get(f"model.layers.0.{name}.weight")
        if entry is None:
            return False, (f"no model.layers.0.{name}.weight in the checkpoint: save "
                           "get_state_dict's model state under \"model\"")
        pieces[name] = len(getattr(entry, "chunks", [None]))
    if all(count == FINAL_RANKS for count in pieces.values()):
        return True, f"attention and MLP weights saved in {FINAL_RANKS} shards (dp x tp)"
    name, count = min(pieces.items(), key=lambda item: item[1])
    return False, (f"layers.0.{name} saved in {count} piece(s), not {FINAL_RANKS}: shard it over "
                   "both axes (tensor parallel over tp, fully_shard over dp)")


def check_resumable(checkpoint, args):
    """(passed, message): the checkpoint loads into the one-process model and optimizer."""
    saved = set(FileSystemReader(checkpoint).read_metadata().state_dict_metadata)
    if not any(key.startswith("optim.state.") for key in saved):
        return False, ("no optimizer state: a resume would restart AdamW's moments; save "
                       "get_state_dict's optimizer state under \"optim\"")
    if "step" not in saved:
        return False, "no \"step\": a resume would not know where to go on"
    model = lm.build_model(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    try:
        step = lm.load_checkpoint(checkpoint.parent, model, optimizer)
    except Exception as error:  # the loader's own message says which key or shape
        return False, f"does not load into one process: {str(error).splitlines()[0][:160]}"
    if step != FINAL_STOP:
        return False, f"saved \"step\" {step}, but the leg stopped after step {FINAL_STOP}"
    return True, f"model, AdamW state and step {step} load into one process"


def final_weights(checkpoint, args):
    model = lm.build_model(args.seed)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)  # only the keys asked for
    return state["model"]


def check_lm_parameters(state, args, tol):
    reference = run_lm(args)[1].state_dict()
    diff = max_diff(state, reference)
    if diff <= tol:
        return True, f"max |param diff| {diff:.1e} <= {tol:.0e}"
    return False, (f"max |param diff| {diff:.1e} > {tol:.0e} (is the optimizer's state loaded "
                   "on resume? do the two tp ranks of a replica read the same sequences, the "
                   "batch split by the dp rank?)")


def check_resumed_leg(proc, problem, out, args):
    passed, message = clean_exit(proc, problem)
    if not passed:
        return False, message
    path = out / "losses.json"
    steps = len(json.loads(path.read_text())) if path.exists() else 0
    if steps != args.steps:
        return False, (f"losses.json holds {steps} steps after the resume; the original trains "
                       f"{args.steps} (keep the first leg's, append the rest)")
    return True, f"{message}; losses.json covers all {steps} steps"


def grade_final(port, out, tol, timeout_s):
    """[(check, passed, message)]: two legs at 4 ranks, stopped after FINAL_STOP, resumed."""
    args = lm.parse_args(["--out", str(out)])
    checkpoint = out / "checkpoint"
    proc, problem = run_port(port, out, timeout_s, FINAL_RANKS,
                             ["--stop-at-step", str(FINAL_STOP)])
    results = [("first leg", *clean_exit(proc, problem))]
    if not results[-1][1]:
        return results
    results.append(("layout", *check_layout(checkpoint)))
    if not results[-1][1]:
        return results
    results.append(("checkpoint", *check_resumable(checkpoint, args)))
    proc, problem = run_port(port, out, timeout_s, FINAL_RANKS)
    results.append(("resumed leg", *check_resumed_leg(proc, problem, out, args)))
    if not results[-1][1]:
        return results
    params_ok, message = check_lm_parameters(final_weights(checkpoint, args), args, tol)
    results.append(("parameters", params_ok, message))
    results.append(("losses", *check_losses(json.loads((out / "losses.json").read_text()),
                                            run_lm(args)[0], tol, params_ok)))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", help="your port of capstone/train_plain.py, or with --final of "
                                     "capstone/train_transformer.py")
    parser.add_argument("--final", action="store_true",
                        help="the final capstone: 2-D (dp x tp) on 4 ranks, stopped and resumed")
    parser.add_argument("--tol", type=float, default=1e-5, help="max |difference| allowed")
    parser.add_argument("--timeout-s", type=float, default=180, help="limit for each torchrun run")
    args = parser.parse_args(argv)
    if not Path(args.port).is_file():
        print(f"grade.py: error: no such file: {args.port}", file=sys.stderr)
        return 2
    grade_port, expected = (grade_final, 6) if args.final else (grade, 4)
    with tempfile.TemporaryDirectory() as folder:
        results = grade_port(Path(args.port).resolve(), Path(folder) / "out", args.tol,
                             args.timeout_s)
    for check, passed, message in results:
        print(f"{'PASS' if passed else 'FAIL'}  {check:<11} {message}")
    passed = all(ok for _, ok, _ in results) and len(results) == expected
    print(f"verdict: {'PASS' if passed else 'FAIL'} ({Path(args.port).name})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
