"""Exercise 5: a pipeline schedule by hand. Write GPipe, then 1F1B, over send and recv.

Grade it (the grader starts its own ranks, 2 and then 3, on gloo; plain python, not torchrun):
    python exercises/grade.py pipeline

What to build: one training step of a pipeline, one stage per rank. The batch is cut into
num_microbatches equal microbatches; each flows forward through the stages (rank 0 first),
activations travelling rank r -> r + 1, and backward through them again, the gradient of each
received activation travelling back rank r -> r - 1. Autograd stops at the process boundary:
the stage that received an activation computes its gradient (mark the received tensor with
requires_grad_() before the stage's forward, read its .grad after the backward) and sends it
back; the stage that sent the activation calls output.backward(received_gradient).
  1. run_gpipe: every forward, then every backward. Write the forward and the backward of
     one microbatch first (the sketch StageRunner below is one way), then the order.
  2. run_1f1b: the same two pieces in 1F1B's order, which holds at most p - rank
     microbatches' activations on rank `rank` instead of all of them.

The contract (what the grader calls, when, and what must hold):
  - The default process group is initialised (gloo, CPU; 2 ranks, then 3) before anything
    here runs. Rank r holds stage r of p = world_size stages: the grader's module, built
    from one seed, so together the stages are one model.
  - Each rank calls, with the same arguments but its own stage,
        loss = run_gpipe(stage, inputs, targets, loss_fn, num_microbatches, record)
        loss = run_1f1b(stage, inputs, targets, loss_fn, num_microbatches, record)
    inputs [batch, dim] and targets [batch]: the whole batch, on every rank (rank 0 reads
    inputs, the last rank targets). batch is a multiple of num_microbatches: microbatch i is
    inputs.chunk(num_microbatches)[i] (and the same chunk of targets). num_microbatches need
    not be a multiple of p (the grader uses 3 and 4).
    The activation between two stages has the shape of an inputs microbatch,
    [batch / num_microbatches, dim]: allocate the receive buffer like that.
    loss_fn(logits, targets) -> the mean loss over a microbatch's rows; only the last stage
    calls it, on its stage's output.
  - After the call, every parameter of `stage` has .grad = the gradient of the mean loss
    over the whole batch (one process running the whole model on the whole batch, fp32,
    within 1e-5): with equal microbatches, backward each microbatch's loss / num_microbatches.
    The .grad starts as None; accumulate over microbatches (backward does that).
  - Return value: on the last stage, the mean loss over the whole batch (a float or a 0-d
    tensor); anything (None) on the other stages.
  - record(action, microbatch): call it on this rank right before computing each microbatch's
    forward, record("F", i), and each backward, record("B", i) (before its receive is fine).
    The grader checks the order against the schedules below, and checks it against what the
    stage really computed (its own hooks see each forward and backward).
      GPipe (as torch.distributed.pipelining.ScheduleGPipe): F0 F1 ... F(m-1), then
        B0 B1 ... B(m-1): backwards in microbatch order, the first microbatch first.
      1F1B (as torch.distributed.pipelining.Schedule1F1B runs it): on rank r, a warm-up of
        w = min(m, p - r) forwards F0 ... F(w-1); then B0, F(w), B1, F(w+1), ... (one
        backward, then one forward) until the forwards run out; then the remaining
        backwards in order. On 2 ranks and 4 microbatches:
            rank 0: F0 F1 B0 F2 B1 F3 B2 B3
            rank 1: F0 B0 F1 B1 F2 B2 F3 B3
        Megatron-LM describes the same order as p - r - 1 warm-up forwards, then one forward
        and one backward at a time: the same actions in the same order.
    Under 1F1B rank r never holds more than p - r microbatches' activations (forwards done
    whose backward has not run yet); under GPipe every rank holds all m.
  - Communication: point-to-point only, with dist.send / recv / isend / irecv or
    batch_isend_irecv; the grader counts the messages. Per step, stage r < p - 1 sends m
    activations to r + 1, and stage r > 0 sends m gradients to r - 1: 2(p-1)m messages in
    all, each received once.
  - gloo's dist.send blocks until the peer posts the matching receive. Two ranks that both
    send first wait for each other for ever (under 1F1B: rank 0 sending F1's activation
    while rank 1 sends B0's gradient). Post sends with dist.isend, keep the works, and wait
    for them at the end of the step; receive with dist.recv. The grader stops a check that
    runs past its limit (--timeout, 30 s) and names it: a deadlock.

The adapter: the grader calls only the two module-level functions run_gpipe and run_1f1b,
with the signature above. Helpers may have any names.

Lesson: lessons/04_pipeline.py (pipeline_workers.gpipe_by_hand: two stages, blocking sends).
A solution: exercises/solutions/pipeline.py (try first).
"""

import torch
import torch.distributed as dist


class StageRunner:
    """A sketch: this rank's stage, one microbatch at a time. Keep what backward needs per
    microbatch (the received input, the output or loss) until that microbatch's backward."""

    def __init__(self, stage, inputs, targets, loss_fn, num_microbatches, record):
        raise NotImplementedError(
            "implement StageRunner.__init__: this rank and p, the microbatches, a place for "
            "the activations in flight, the send works and the losses")

    def forward(self, i):
        raise NotImplementedError(
            "implement StageRunner.forward: record('F', i); receive the activation (not on "
            "rank 0), requires_grad_(), run the stage; send the output on (isend) or, on the "
            "last stage, keep loss_fn(output, targets) / num_microbatches")

    def backward(self, i):
        raise NotImplementedError(
            "implement StageRunner.backward: record('B', i); the last stage backwards its "
            "loss, the others receive the gradient and call output.backward(gradient); send "
            "the input's .grad back (not on rank 0)")

    def finish(self):
        raise NotImplementedError(
            "implement StageRunner.finish: wait for every send; the mean loss on the last "
            "stage")


# The grader's entry points (the adapter). Keep these two names and signatures.
def run_gpipe(stage, inputs, targets, loss_fn, num_microbatches, record):
    raise NotImplementedError(
        "implement run_gpipe: forward every microbatch in order, then backward every "
        "microbatch in order (F0..F(m-1), B0..B(m-1)); return the mean loss on the last stage")


def run_1f1b(stage, inputs, targets, loss_fn, num_microbatches, record):
    raise NotImplementedError(
        "implement run_1f1b: min(m, p - rank) warm-up forwards, then one backward and one "
        "forward at a time, then the remaining backwards")
