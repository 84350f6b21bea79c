"""Checks for exercise ring (ring attention by hand), at 2 ranks and then at 3. The contract is
in exercises/ring.py.

Every rank makes the same q, k, v and dout for the whole sequence from one seed and hands the
learner its contiguous slice; one process's attention on the whole sequence, sliced the same
way, is the reference. When the forward is wrong, the grader recomputes this rank's output
the way a ring making each usual mistake would (averaging instead of log-sum-exp, the mask on
every block, v left at home, ...) and names the one that matches. The rotations are counted with
spy.PointToPointSpy. The backward is the optional part: a backward that raises
NotImplementedError is reported as "not attempted", without stopping the grading; those
checks count as not passed, so the exit status is 0 only for the complete exercise.
"""

import math

import torch

from .checks import Check, Exercise, failed, passed
from .compare import TOL, differing, format_bytes, max_abs_diff, name_list, scale_of
from .solution import one_line
from .spy import PointToPointSpy

HEADS, SEQ, HEAD_DIM = 2, 12, 8  # SEQ: a multiple of 2 and 3


def make_inputs():
    """q, k, v and dout for the whole sequence, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(HEADS, SEQ, HEAD_DIM, generator=generator) for _ in range(4)]


def scores_of(q, k, causal, mask=None):
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is None and causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
    return scores if mask is None else scores.masked_fill(mask, float("-inf"))


def full_attention(q, k, v, causal):
    """(out, lse) on the whole sequence: what one process computes."""
    scores = scores_of(q, k, causal)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def reference_grads(q, k, v, dout, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = full_attention(q, k, v, causal)
    (out * dout).sum().backward()
    return q.grad, k.grad, v.grad


def local(tensor, ctx, dim=-2):
    """This rank's contiguous slice of a whole-sequence tensor."""
    return tensor.chunk(ctx.world_size, dim=dim)[ctx.rank].contiguous()


# --- what a ring with a usual mistake computes, for naming the mistake -------------------------

MISTAKES = {
    "average": "merged by averaging? your out is the plain average of the blocks' partial "
               "outputs: weight each by exp(lse_block - lse_merged), the log-sum-exp rule",
    "mean": "merged by averaging? your out is the plain mean of the blocks' partial outputs: "
            "weight each by exp(lse_block - lse_merged), the log-sum-exp rule",
    "mask every block": "the causal mask is applied to every block: only the diagonal block "
                        "(this rank's own keys) needs it; an earlier rank's slice is wholly "
                        "visible",
    "no skip": "later ranks' slices are not skipped: under causal attention a query sees no "
               "key after it; skip the blocks of slices from later ranks",
    "no diagonal mask": "the diagonal block (this rank's own keys) is not masked: query i of "
                        "the slice sees keys 0..i of it only",
    "no mask": "causal=True but your out is the non-causal attention: mask the diagonal block "
               "and skip the slices of later ranks",
    "wrong source": "the wrong blocks are skipped: with slices sent to rank + 1, at step s "
                    "this rank holds rank (r - s) % p's slice; an earlier rank's is wholly "
                    "visible, a later one's skipped",
    "own v": "every block used this rank's own v: v must travel around the ring with k",
    "own k": "every block used this rank's own k: k must travel around the ring with v",
    "local only": "your out is attention over this rank's own slice only: did the received "
                  "k and v slices get used?",
}


def mistaken_blocks(q, k, v, rank, world_size, causal, mistake):
    """[(scores, values)] of the blocks that a ring sending slices to rank + 1 and making
    `mistake` computes on `rank`, in the order it meets them."""
    q_local = q.chunk(world_size, dim=-2)[rank]
    k_chunks, v_chunks = k.chunk(world_size, dim=-2), v.chunk(world_size, dim=-2)
    n = q_local.shape[-2]
    triangle = torch.ones(n, n, dtype=torch.bool).triu(1)
    blocks = []
    for step in range(1 if mistake == "local only" else world_size):
        source = (rank - step) % world_size  # whose slice this rank holds at this step
        judged = (rank + step) % world_size if mistake == "wrong source" else source
        if causal and judged > rank and mistake not in ("no skip", "no mask"):
            continue
        diagonal = causal and judged == rank and mistake not in ("no diagonal mask", "no mask")
        if mistake == "mask every block":
            diagonal = causal
        k_block = k_chunks[rank if mistake == "own k" else source]
        scores = scores_of(q_local, k_block, False, triangle if diagonal else None)
        blocks.append((scores, v_chunks[rank if mistake == "own v" else source]))
    return blocks


def ring_as_mistaken(q, k, v, rank, world_size, causal, mistake):
    """This rank's out from a ring that makes `mistake`; merged by averaging for "average"
    (pairwise, in ring order) and "mean", else the right way (one softmax over its blocks)."""
    blocks = mistaken_blocks(q, k, v, rank, world_size, causal, mistake)
    partial = [torch.softmax(scores, dim=-1) @ values for scores, values in blocks]
    if mistake == "mean":
        return torch.stack(partial).mean(0)
    if mistake == "average":
        out = partial[0]
        for block in partial[1:]:
            out = (out + block) / 2
        return out
    scores = torch.cat([scores for scores, _ in blocks], dim=-1)
    return torch.softmax(scores, dim=-1) @ torch.cat([values for _, values in blocks], dim=-2)


def name_forward_mistake(ctx, q, k, v, causal, out, want_out):
    """The usual mistake whose output this rank's out equals, or None."""
    for mistake, message in MISTAKES.items():
        candidate = ring_as_mistaken(q, k, v, ctx.rank, ctx.world_size, causal, mistake)
        if (candidate - want_out).abs().max() <= TOL:
            continue  # this mistake makes no difference here (rank 0, or not causal)
        if (out - candidate).abs().max() <= TOL:
            return message
    return None


def explain_forward(ctx, inputs, causal, out, lse, want_out, want_lse):
    q, k, v, _ = inputs
    if torch.isnan(out).any():
        return ("NaN in out: a block with every key masked (a later rank's slice under "
                "causal) has lse = -inf, and exp(-inf - -inf) is NaN: skip such blocks")
    named = name_forward_mistake(ctx, q, k, v, causal, out, want_out)
    if named:
        return named
    out_right = (out - want_out).abs().max() <= TOL
    lse_right = (lse - want_lse).abs().max() <= TOL
    if out_right:
        return ("out is right but lse is not: lse is logsumexp(scale * q k^T) over every key a "
                "query sees, the blocks' lse merged with logaddexp")
    if lse_right:
        return ("lse is right but out is not: merge the partial outputs with the weights "
                "exp(lse_block - lse_merged), which sum to one")
    return "out and lse both differ from one process's attention"


def make_forward_check(causal):
    def check_forward(ctx):
        inputs = make_inputs()
        q, k, v, _ = inputs
        result = ctx.entry("ring_attention_forward")(local(q, ctx), local(k, ctx),
                                                     local(v, ctx), causal)
        want_out, want_lse = (local(t, ctx, dim) for t, dim
                              in zip(full_attention(q, k, v, causal), (-2, -1)))
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            return failed(f"ring_attention_forward returned {type(result).__name__}: it "
                          "returns (out, lse)")
        out, lse = result
        for name, got, want in (("out", out, want_out), ("lse", lse, want_lse)):
            if not torch.is_tensor(got) or got.shape != want.shape:
                shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
                return failed(f"{name} is {shape}, expected {tuple(want.shape)} (this rank's "
                              "queries)")
        diff, _ = max_abs_diff({"out": out, "lse": lse}, {"out": want_out, "lse": want_lse})
        if diff <= TOL:
            return passed(diff=diff)
        return failed(explain_forward(ctx, inputs, causal, out, lse, want_out, want_lse), diff)
    return check_forward


def explain_rotations(spy, label, rank, world_size, slice_bytes, half_bytes):
    """What is off in one forward's messages on this rank, or None."""
    sent_to = {m.peer for m in spy.messages if m.kind == "send"}
    received_from = {m.peer for m in spy.messages if m.kind == "recv"}
    after, before = (rank + 1) % world_size, (rank - 1) % world_size
    if not spy.messages:
        return (f"{label}: no point-to-point message seen: pass k and v around the ring with "
                "dist.send / recv, isend / irecv or batch_isend_irecv (an all-gather of k and "
                "v is not a ring)")
    if (sent_to, received_from) not in (({after}, {before}), ({before}, {after})):
        return (f"{label}: rank {rank} sent to rank(s) {sorted(sent_to)} and received from "
                f"{sorted(received_from)}: a ring sends to one neighbour and receives from "
                "the other")
    want = (world_size - 1) * slice_bytes
    for kind, verb in (("send", "sent"), ("recv", "received")):
        got = spy.bytes(kind)
        if got == want:
            continue
        if got == (world_size - 1) * half_bytes:
            hint = ": each rotation carried one slice, not k and v: does v stay home?"
        elif got == world_size * slice_bytes:
            hint = (": p rotations; the last only brings each slice back home, the forward "
                    "needs p - 1")
        else:
            hint = f" ({got / slice_bytes:g} rotations of k and v)"
        return (f"{label}: rank {rank} {verb} {format_bytes(got)}, expected (p - 1) x "
                f"(k.nbytes + v.nbytes) = {format_bytes(want)}{hint}")
    return None


def check_rotations(ctx):
    q, k, v, _ = (local(t, ctx) for t in make_inputs())
    spies = {}
    for causal in (False, True):
        with PointToPointSpy() as spies[causal]:
            ctx.entry("ring_attention_forward")(q.clone(), k.clone(), v.clone(), causal)
    for causal, spy in spies.items():
        problem = explain_rotations(spy, "causal" if causal else "non-causal", ctx.rank,
                                    ctx.world_size, k.nbytes + v.nbytes, k.nbytes)
        if problem:
            return failed(problem)
    num_sends = spies[True].count("send")
    return passed(f"p - 1 = {ctx.world_size - 1} rotation(s) of k and v per forward, causal "
                  f"or not: {format_bytes(spies[True].bytes('send'))} sent per rank in "
                  f"{num_sends} message(s)")


def make_backward_check(causal):
    def check_backward(ctx):
        q, k, v, dout = make_inputs()
        out, lse = full_attention(q, k, v, causal)
        want = dict(zip(("dq", "dk", "dv"),
                        (local(g, ctx) for g in reference_grads(q, k, v, dout, causal))))
        args = [local(t, ctx) for t in (q, k, v, out)] + [local(lse, ctx, -1), local(dout, ctx)]
        try:
            result = ctx.entry("ring_attention_backward")(*args, causal)
        except NotImplementedError as exc:
            return failed(f"not attempted: NotImplementedError: {one_line(exc)} (the optional "
                          "part: the exercise is complete when it passes)")
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            return failed(f"ring_attention_backward returned {type(result).__name__}: it "
                          "returns (dq, dk, dv)")
        got = dict(zip(want, result))
        for name, grad in got.items():
            if not torch.is_tensor(grad) or grad.shape != want[name].shape:
                shape = tuple(grad.shape) if torch.is_tensor(grad) else type(grad).__name__
                return failed(f"{name} is {shape}, expected {tuple(want[name].shape)}")
        diff, _ = max_abs_diff(got, want)
        if diff <= TOL:
            return passed(diff=diff)
        wrong = differing(got, want)
        scale = scale_of([got[n] for n in wrong], [want[n] for n in wrong])
        times = f"{scale:.2f}x the reference" if scale is not None else "not a multiple of it"
        if "dq" not in wrong:
            return failed(f"dq is right but {name_list(wrong)} not ({times}): a k/v slice's "
                          "gradient has a share from every rank's queries: carry dk and dv "
                          "around the ring with their slice, adding each rank's share, until "
                          "they are home", diff)
        return failed(f"wrong for {name_list(wrong)} ({times})", diff)
    return check_backward


EXERCISE = Exercise(
    name="ring",
    stub="ring.py",
    entry_points=("ring_attention_forward", "ring_attention_backward"),
    checks=(
        Check("forward: out and lse equal one process (non-causal)", make_forward_check(False)),
        Check("forward: out and lse equal one process (causal)", make_forward_check(True)),
        Check("forward: k and v make p - 1 rotations around the ring", check_rotations),
        Check("backward (optional): dq, dk, dv equal one process (non-causal)",
              make_backward_check(False)),
        Check("backward (optional): dq, dk, dv equal one process (causal)",
              make_backward_check(True)),
        Check("forward, 3 ranks: out and lse equal one process (non-causal)",
              make_forward_check(False), 3),
        Check("forward, 3 ranks: out and lse equal one process (causal)",
              make_forward_check(True), 3),
        Check("forward, 3 ranks: k and v make p - 1 rotations around the ring",
              check_rotations, 3),
        Check("backward (optional), 3 ranks: dq, dk, dv equal one process (causal)",
              make_backward_check(True), 3),
    ),
)
