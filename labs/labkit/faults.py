"""The fault drills: flags that make one rank die, stall, or crash mid-checkpoint, so the
tests (and the runbooks' drills) can show that the run fails fast and resumes cleanly. The
kit's loop and checkpoint writers call these hooks; a lab never does."""

import os
import sys
import time

from labkit.errors import fail_config, refuse_negative


def add_drill_args(parser):
    arg = parser.add_argument
    arg("--fail-at-step", type=int, default=0,
        help="fault drill: --fail-rank dies abruptly at this step, first attempt only (0: never)")
    arg("--fail-rank", type=int, default=0, help="fault drill: which rank dies")
    arg("--crash-in-checkpoint", type=int, default=0,
        help="fault drill: die while writing the checkpoint of this step, before it is complete")
    arg("--stall-at-step", type=int, default=0,
        help="fault drill: --fail-rank stops responding at this step, first attempt only; the "
             "others must fail within --timeout-s (0: never)")


def validate_drill_args(cfg, world_size):
    refuse_negative(cfg, ["fail_at_step", "fail_rank", "crash_in_checkpoint", "stall_at_step"])
    if cfg.fail_rank >= world_size:
        fail_config("--fail-rank", f"{cfg.fail_rank} is not a rank of a world of {world_size}")
    if cfg.crash_in_checkpoint and not cfg.checkpoint_dir:
        fail_config("--checkpoint-dir", "required by --crash-in-checkpoint")


def first_attempt():
    """Drills fire on torchrun's first attempt only, so the restarted run can get past them."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def maybe_inject_failure(cfg, step, rank):
    """--fail-at-step K --fail-rank R: rank R dies abruptly (no cleanup) at step K."""
    if first_attempt() and step == cfg.fail_at_step and rank == cfg.fail_rank:
        print(f"injected failure: rank {rank} exits at step {step}", file=sys.stderr, flush=True)
        os._exit(13)


def maybe_crash_mid_checkpoint(cfg, step):
    """--crash-in-checkpoint K: die after part of step K's checkpoint is on disk but before it
    is complete, as an OOM kill or a power cut would."""
    if first_attempt() and step == cfg.crash_in_checkpoint:
        print(f"injected crash while writing the checkpoint of step {step}", file=sys.stderr,
              flush=True)
        os._exit(14)


def maybe_stall(cfg, step, rank, preemption):
    """--stall-at-step K --fail-rank R: rank R stops responding at step K but stays alive, as a
    rank stuck in I/O or behind a dead link would. Its peers block in their next collective
    with it, on whichever group that is, and must fail after --timeout-s. A SIGTERM (torchrun
    stopping the job) ends the stall, so the drill never outlives the job."""
    if first_attempt() and step == cfg.stall_at_step and rank == cfg.fail_rank:
        print(f"injected stall: rank {rank} stops responding at step {step}", file=sys.stderr,
              flush=True)
        deadline = time.monotonic() + 10 * cfg.timeout_s
        while time.monotonic() < deadline and not preemption.requested:
            time.sleep(0.1)
