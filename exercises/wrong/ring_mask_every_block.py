"""Applies the causal mask to every block it computes, not only the diagonal one."""


import math

import torch
import torch.distributed as dist


def attention_block(q, k, v, scale, diagonal):
    """(out, lse) of queries q over one block of keys: out is normalised over this block only;
    lse = log(sum(exp(scores))) per query is what lets blocks be merged."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if diagonal:  # this rank's own keys: query i sees keys 0..i of the slice
        scores = scores.masked_fill(causal_mask(q.shape[-2]), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def causal_mask(n):
    """True where a key comes after its query (masked)."""
    return torch.ones(n, n, dtype=torch.bool).triu(1)


def merge(out, lse, block_out, block_lse):
    """The attention over both key sets: each part re-weighted by exp(its lse - L), with
    L = logaddexp(lse, block_lse); the weights sum to one and no raw score is exponentiated."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out = (out * torch.exp(lse - new_lse).unsqueeze(-1)
           + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    return out, new_lse


def post_rotation(tensor):
    """Send tensor to the next rank and receive the previous rank's, both posted at once
    (a blocking send on gloo waits for the peer's receive: every rank sending first would
    deadlock). Returns (the tensor being received, the requests to wait for)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), (rank + 1) % world_size),
           dist.P2POp(dist.irecv, received, (rank - 1) % world_size)]
    return received, dist.batch_isend_irecv(ops)


def finish_rotation(posted):
    received, requests = posted
    for request in requests:
        request.wait()
    return received


def visible(rank, source, causal):
    """Which of the keys of rank `source`'s slice this rank's queries see: None (skip the
    block), "all", or "diagonal" (the triangular mask)."""
    if not causal or source < rank:
        return "all"
    return "diagonal" if source == rank else None


def ring_attention_forward(q, k, v, causal):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = lse = None
    kv = torch.stack([k, v])  # one message per rotation
    for step in range(world_size):
        # Post the next rotation before computing, so the slice travels while this step
        # computes with it; nothing writes to kv meanwhile.
        in_flight = post_rotation(kv) if step < world_size - 1 else None
        source = (rank - step) % world_size  # whose slice kv holds at this step
        seen = visible(rank, source, causal)
        if seen is not None:  # step 0 is this rank's own slice: never skipped
            out, lse = merge(out, lse, *attention_block(q, kv[0], kv[1], scale, causal))
        if in_flight:
            kv = finish_rotation(in_flight)
    return out, lse


def ring_attention_backward(q, k, v, out, lse, dout, causal):
    raise NotImplementedError("this wrong solution stops at the forward")
