"""Exercise 6: ring attention by hand. Pass k and v around a ring; merge with log-sum-exp.

Grade it (the grader starts its own ranks, 2 and then 3, on gloo; plain python, not torchrun):
    python exercises/grade.py ring

What to build: attention over a sequence cut into p contiguous slices, one per rank, where no
rank ever holds the whole sequence's keys and values.
  1. The forward. Each rank starts with its own k and v slice. p steps: attend this rank's
     queries to the slice it holds now (one block), then pass that slice to the next rank and
     take the previous rank's (p - 1 rotations). Each block gives a partial output normalised
     over that block's keys only, and its log-sum-exp; merge the blocks with the log-sum-exp
     rule: with L = logaddexp(lse_a, lse_b),
         out = out_a * exp(lse_a - L) + out_b * exp(lse_b - L),   lse = L
     which is the softmax over the union of the two key sets (never their plain average).
     Causal: a query sees keys at or before its own position. With contiguous slices, a block
     of keys from an earlier rank is wholly visible, a later rank's is skipped, and only the
     diagonal block (this rank's own keys) needs the triangular mask.
  2. The backward (optional: you may stop after the forward; see "Verdict" below). Given the
     final out and lse, one block's share of the softmax is P = exp(scale * q k^T - lse), so
     each block's gradients are computed on its own: with delta = rowsum(dout * out),
         dv += P^T dout,   dS = P * (dout v^T - delta),   dq += scale * dS k,
         dk += scale * dS^T q.
     dq stays home; the dk and dv of a slice collect a share from every rank's queries, so
     they travel around the ring with the slice (or are sent back to its owner).

The contract (what the grader calls, when, and what must hold):
  - The default process group is initialised (gloo, CPU; 2 ranks, then 3) before anything
    here runs. The sequence, of length S (a multiple of p), is cut into p contiguous slices:
    rank r holds positions [r * S / p, (r + 1) * S / p).
  - Each rank calls
        out, lse = ring_attention_forward(q, k, v, causal)
    q, k, v: this rank's slices, [heads, S / p, head_dim], fp32. causal: True or False.
    out [heads, S / p, head_dim]: softmax(scale * q K^T (masked if causal)) V for this rank's
    queries over the whole sequence's keys K and values V, scale = 1 / sqrt(head_dim): one
    process's attention on the whole sequence, sliced (fp32, within 1e-5).
    lse [heads, S / p]: log(sum(exp(scale * q K^T))) per query over every key it sees
    (natural log, the masked keys left out): what the backward needs.
  - Communication, forward: point-to-point only (dist.send / recv, isend / irecv or
    batch_isend_irecv), around the ring: send to rank + 1 and receive from rank - 1 (modulo
    p), or the other way round on every rank. Exactly p - 1 rotations of k and v, causal or
    not, each carrying this rank's current k and v (together, e.g. torch.stack([k, v]), or as
    two messages): (p - 1) * (k.nbytes + v.nbytes) sent per rank. The grader counts them. An
    all-gather of k and v is not a ring.
    gloo's dist.send blocks until the peer posts the matching receive, and in a ring every
    rank sends at once: post the send and the receive together (dist.batch_isend_irecv, or
    isend then recv) so no rank waits for ever. The grader stops a check that runs past its
    limit (--timeout, 30 s) and names it: a deadlock.
  - Each rank calls, for the backward (a separate check set, marked optional),
        dq, dk, dv = ring_attention_backward(q, k, v, out, lse, dout, causal)
    q, k, v as above; out and lse: the forward's for these inputs (the grader passes one
    process's, sliced, so your backward is judged on its own); dout: the gradient of this
    rank's out. Return this rank's slices of the gradients of sum(out * dout) over the whole
    sequence with respect to q, k and v (fp32, within 1e-5). Any communication you like.
  - Verdict: a backward that raises NotImplementedError is "not attempted": its checks fail
    with that message and do not stop the grading, so a forward-only file sees its forward
    checks pass. The verdict counts them as not passed, and the exit status is 0 only when
    every check passed: the exercise is complete with the backward.

The adapter: the grader calls only the two module-level functions ring_attention_forward and
ring_attention_backward, with the signatures above. Helpers may have any names.

Lesson: lessons/07_context_parallel.py (context_workers.py: a zigzag ring with both passes).
A solution: exercises/solutions/ring.py (try first).
"""

import math

import torch
import torch.distributed as dist


def attention_block(q, k, v, scale, diagonal):
    """(out, lse) of queries q over one block of keys k, v; the triangular mask if diagonal."""
    raise NotImplementedError(
        "implement attention_block: scores = scale * q @ k^T, the causal mask on the diagonal "
        "block, lse = logsumexp over the keys, out = exp(scores - lse) @ v")


def merge(out, lse, block_out, block_lse):
    """The attention over two disjoint key sets, from each one's (out, lse)."""
    raise NotImplementedError(
        "implement merge: L = logaddexp(lse, block_lse); weight each out by exp(its lse - L)")


# The grader's entry points (the adapter). Keep these two names and signatures.
def ring_attention_forward(q, k, v, causal):
    raise NotImplementedError(
        "implement ring_attention_forward: p steps, each an attention block merged by "
        "log-sum-exp, k and v passed to the next rank between steps (p - 1 rotations)")


def ring_attention_backward(q, k, v, out, lse, dout, causal):
    raise NotImplementedError(
        "implement ring_attention_backward: each block's dq, dk, dv from the final "
        "lse; dk and dv travel with their slice around the ring")
