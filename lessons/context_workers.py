"""Worker functions for lessons/07_context_parallel.py (run with spawn.run_workers).

Ring attention by hand. Each rank holds a slice of the sequence: its queries, keys and values.
The key/value slices travel around the ring (rank r sends to r+1 and receives from r-1), and
each rank merges the partial attention of every slice it sees with the log-sum-exp rule, so no
rank ever holds the whole sequence's keys and values, let alone the S x S score matrix.

A sequence of length S is cut into chunks; `chunk_ids` says which chunks a rank holds:
  * "contiguous": p chunks, rank r holds chunk r (the naive split);
  * "zigzag": 2p chunks, rank r holds chunks r and 2p-1-r (the head-tail split, which gives
    every rank the same causal work).
Tensors are [heads, tokens, head_dim]; a rank's tokens are its chunks, concatenated in order.
"""

import math
import time

import torch
import torch.distributed as dist


# --- the layout of the sequence over the ring --------------------------------------------------

def num_chunks(world_size, layout):
    return world_size if layout == "contiguous" else 2 * world_size


def chunk_ids(rank, world_size, layout):
    """The chunks of the sequence that rank holds, in the order they sit in its tensors."""
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    raise ValueError(f"unknown layout {layout!r}: contiguous or zigzag")


def shard_sequence(full, rank, world_size, layout, seq_dim=-2):
    """This rank's slice of a full-sequence tensor."""
    chunks = full.chunk(num_chunks(world_size, layout), dim=seq_dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, world_size, layout)], dim=seq_dim)


def unshard_sequence(slices, layout, seq_dim=-2):
    """The inverse of shard_sequence: slices[r] is rank r's slice."""
    world_size = len(slices)
    ordered = {}
    for rank, local in enumerate(slices):
        ids = chunk_ids(rank, world_size, layout)
        for chunk_id, chunk in zip(ids, local.chunk(len(ids), dim=seq_dim)):
            ordered[chunk_id] = chunk
    return torch.cat([ordered[i] for i in sorted(ordered)], dim=seq_dim)


def visible(q_chunk, k_chunk, causal):
    """Which keys a query chunk attends to: None (skip the block), "all", or "diagonal"."""
    if not causal or k_chunk < q_chunk:
        return "all"
    return "diagonal" if k_chunk == q_chunk else None


# --- one block, and the log-sum-exp merge ------------------------------------------------------

def attention_block(q, k, v, scale, diagonal):
    """Attention of a query chunk to one key chunk: (out, lse). out is softmax-normalised over
    this block only; lse = log(sum(exp(scores))) per query is what lets blocks be merged."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if diagonal:  # the same chunk of the sequence: query i sees keys 0..i
        scores = scores.masked_fill(causal_mask(q.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def causal_mask(n, device):
    """True where a key comes after its query (masked)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def merge(out, lse, block_out, block_lse):
    """Combine two partial attentions over disjoint key sets into the attention over both.
    With L = logaddexp(lse_a, lse_b), softmax over the union re-weights each part by
    exp(lse_part - L): the weights sum to one, and no exp of a raw score can overflow."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out = (out * torch.exp(lse - new_lse).unsqueeze(-1)
           + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    return out, new_lse


# --- the ring ---------------------------------------------------------------------------------

def rank_and_size(group=None):
    """(rank, world size) in the group; (0, 1) with no process group, so one process can run
    the same code as a ring of one."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def post_rotation(tensor, group=None):
    """Start the ring's one step: send tensor to the next rank, receive the previous rank's.
    Both directions are posted together (batch_isend_irecv), so no pair of ranks deadlocks.
    Returns (the tensor being received, its requests): finish_rotation waits for it."""
    rank, world_size = rank_and_size(group)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), (rank + 1) % world_size, group),
           dist.P2POp(dist.irecv, received, (rank - 1) % world_size, group)]
    return received, dist.batch_isend_irecv(ops)


def finish_rotation(posted):
    received, requests = posted
    for request in requests:
        request.wait()
    return received


def rotate(tensor, group=None):
    """One ring step, blocking: post it, wait for it."""
    if rank_and_size(group)[1] == 1:
        return tensor
    return finish_rotation(post_rotation(tensor, group))


class Work:
    """What one rank computed: blocks of scores, the thread CPU time spent on them, and the
    forward's order of events (when each rotation was posted, used and received)."""

    def __init__(self):
        self.blocks = 0
        self.cpu_s = 0.0
        self.events = []

    def timed(self, fn, *args):
        start = time.thread_time()
        result = fn(*args)
        self.cpu_s += time.thread_time() - start
        self.blocks += 1
        return result


def ring_attention_forward(q, k, v, layout, causal, work=None, group=None):
    """out, lse for this rank's queries over the whole sequence's keys: p steps of compute,
    p-1 rotations of the key/value slice."""
    rank, world_size = rank_and_size(group)
    work = work or Work()
    scale = 1.0 / math.sqrt(q.shape[-1])
    my_ids = chunk_ids(rank, world_size, layout)
    q_chunks = q.chunk(len(my_ids), dim=-2)
    outs, lses = [None] * len(my_ids), [None] * len(my_ids)
    kv = torch.stack([k, v])
    for step in range(world_size):
        # Post the next rotation before computing: the slice travels to rank + 1 (and the
        # previous rank's arrives) while this step computes with it. Only reads touch kv.
        in_flight = post_rotation(kv, group) if step < world_size - 1 else None
        work.events.append(("posted", step) if in_flight else ("last step", step))
        kv_ids = chunk_ids((rank - step) % world_size, world_size, layout)
        k_chunks, v_chunks = (t.chunk(len(kv_ids), dim=-2) for t in kv)
        for qi, q_id in enumerate(my_ids):
            for ki, k_id in enumerate(kv_ids):
                seen = visible(q_id, k_id, causal)
                if seen is None:
                    continue  # a later part of the sequence: causal attention skips it
                block = work.timed(attention_block, q_chunks[qi], k_chunks[ki], v_chunks[ki],
                                   scale, seen == "diagonal")
                outs[qi], lses[qi] = merge(outs[qi], lses[qi], *block)
        work.events.append(("computed", step))
        if in_flight:
            kv = finish_rotation(in_flight)
            work.events.append(("received", step))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def block_backward(q, k, v, dout, lse, delta, scale, diagonal):
    """Gradients of one block, given the final lse (so P is the block's share of the true
    softmax): dv = P^T dout, dS = P * (dout v^T - delta), dq = dS k, dk = dS^T q."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        scores = scores.masked_fill(causal_mask(q.shape[-2], q.device), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dv = probs.transpose(-2, -1) @ dout
    dscores = probs * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (dscores @ k) * scale, (dscores.transpose(-2, -1) @ q) * scale, dv


def ring_attention_backward(q, k, v, out, lse, dout, layout, causal, work=None, group=None):
    """dq, dk, dv. The key/value slice travels with its gradient accumulator: each rank adds
    its queries' share to it, and after p rotations it is back home, complete."""
    rank, world_size = rank_and_size(group)
    work = work or Work()
    scale = 1.0 / math.sqrt(q.shape[-1])
    my_ids = chunk_ids(rank, world_size, layout)
    delta = (dout * out).sum(-1)  # rowsum(dout * out): the softmax backward's correction
    dq = torch.zeros_like(q)
    q_c, dout_c, dq_c = (t.chunk(len(my_ids), dim=-2) for t in (q, dout, dq))
    lse_c, delta_c = (t.chunk(len(my_ids), dim=-1) for t in (lse, delta))
    kv_grad = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
    for step in range(world_size):
        kv_ids = chunk_ids((rank - step) % world_size, world_size, layout)
        k_c, v_c, dk_c, dv_c = (t.chunk(len(kv_ids), dim=-2) for t in kv_grad)
        for qi, q_id in enumerate(my_ids):
            for ki, k_id in enumerate(kv_ids):
                seen = visible(q_id, k_id, causal)
                if seen is None:
                    continue
                dq_b, dk_b, dv_b = work.timed(block_backward, q_c[qi], k_c[ki], v_c[ki],
                                              dout_c[qi], lse_c[qi], delta_c[qi], scale,
                                              seen == "diagonal")
                dq_c[qi].add_(dq_b)  # views into dq, dk, dv: += writes through
                dk_c[ki].add_(dk_b)
                dv_c[ki].add_(dv_b)
        # Blocking: the accumulator is complete only after this step has added to it.
        kv_grad = rotate(kv_grad, group)  # p rotations: the gradients come home
    return dq, kv_grad[2], kv_grad[3]


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd op: saves only this rank's q, k, v, out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, layout, causal, work):
        out, lse = ring_attention_forward(q, k, v, layout, causal, work)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.causal, ctx.work = layout, causal, work
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(q, k, v, out, lse, dout.contiguous(), ctx.layout,
                                             ctx.causal, ctx.work)
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, layout="zigzag", causal=True, work=None):
    return RingAttention.apply(q, k, v, layout, causal, work)


# --- all-to-all context parallelism (DeepSpeed-Ulysses) -------------------------------------

def sequence_to_heads(t, group=None):
    """[heads, seq/p, d] on each rank -> [heads/p, seq, d]: one all-to-all sends head group j
    of this rank's slice to rank j, and receives every rank's slice of its own head group."""
    _, world_size = rank_and_size(group)
    send = t.reshape(world_size, t.shape[0] // world_size, *t.shape[1:]).contiguous()
    received = torch.empty_like(send)  # [source rank = sequence slice, heads/p, seq/p, d]
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=-2)


def heads_to_sequence(t, group=None):
    """The inverse: [heads/p, seq, d] -> [heads, seq/p, d], one all-to-all."""
    _, world_size = rank_and_size(group)
    send = torch.stack(t.chunk(world_size, dim=-2)).contiguous()  # slice j goes to rank j
    received = torch.empty_like(send)  # [source rank = head group, heads/p, seq/p, d]
    dist.all_to_all_single(received, send, group=group)
    return received.reshape(-1, *received.shape[2:])


def ulysses_attention(q, k, v, causal=True, group=None):
    """Attention over a sequence cut in contiguous slices, one per rank, by re-cutting it by
    heads: three all-to-alls give each rank the whole sequence for heads/p heads, it computes
    plain attention on them, and one all-to-all cuts the output back by sequence."""
    full = full_attention(*(sequence_to_heads(t, group) for t in (q, k, v)), causal=causal)
    return heads_to_sequence(full, group)


def forward_traffic(rank, world_size, seq_len, heads=4, head_dim=16):
    """Bytes this rank sent in one causal forward, ring and all-to-all, with the all-to-all
    version's output for the parity check and the ring's order of events."""
    from collective_workers import bytes_written

    q, k, v, _ = make_qkv(seq_len, heads, head_dim)
    local = [shard_sequence(t, rank, world_size, "contiguous") for t in (q, k, v)]
    sent, work = {}, Work()
    for name, attend in [("ring", lambda: ring_attention_forward(*local, "contiguous", True,
                                                                  work)),
                         ("all-to-all", lambda: ulysses_attention(*local))]:
        dist.barrier()
        before = bytes_written()
        output = attend()
        sent[name] = None if before is None else bytes_written() - before
    return {"sent": sent, "slice_bytes": local[0].nbytes, "ulysses_out": output,
            "ring_events": work.events}


# --- the single-process reference, and the inputs every rank shares ---------------------------

def full_attention(q, k, v, causal=True):
    """Plain attention on the whole sequence: what one process computes."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(causal_mask(q.shape[-2], q.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def make_qkv(seq_len, heads=4, head_dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(heads, seq_len, head_dim, generator=generator) for _ in range(3))
    dout = torch.randn(heads, seq_len, head_dim, generator=generator)
    return q, k, v, dout


def saved_bytes(fn):
    """Bytes autograd keeps for backward while fn runs (what activation memory is)."""
    total = [0]

    def pack(tensor):
        total[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return total[0]


# --- workers ----------------------------------------------------------------------------------

def ring_parity(rank, world_size, seq_len, layouts, causal=True):
    """Outputs and gradients of this rank's slice, for each layout (unsharded by the caller)."""
    q, k, v, dout = make_qkv(seq_len)
    results = {}
    for layout in layouts:
        local = [shard_sequence(t, rank, world_size, layout).requires_grad_()
                 for t in (q, k, v)]
        out = ring_attention(*local, layout=layout, causal=causal)
        out.backward(shard_sequence(dout, rank, world_size, layout))
        results[layout] = {"out": out.detach(), "dq": local[0].grad, "dk": local[1].grad,
                           "dv": local[2].grad}
    return results


def ring_work(rank, world_size, seq_len, heads, head_dim, layouts, repeats=3):
    """Blocks computed and thread CPU seconds of one causal forward + backward, per layout:
    the least of `repeats` runs, since a shared machine only ever adds time."""
    q, k, v, dout = make_qkv(seq_len, heads, head_dim)
    results = {}
    for layout in layouts:
        runs = []
        for _ in range(repeats):
            local = [shard_sequence(t, rank, world_size, layout).requires_grad_()
                     for t in (q, k, v)]
            work = Work()
            out = ring_attention(*local, layout=layout, causal=True, work=work)
            out.backward(shard_sequence(dout, rank, world_size, layout))
            runs.append(work)
        results[layout] = {"blocks": runs[0].blocks, "cpu_s": min(w.cpu_s for w in runs),
                           "block_tokens": seq_len // num_chunks(world_size, layout)}
    return results


def replay_ring_work(world_size, seq_len, heads, head_dim, layout, rounds=5):
    """Thread CPU seconds of the blocks each ring rank computes in a causal forward + backward,
    replayed in this process: the same blocks, with no other rank competing for the cores or
    their memory bandwidth. The ranks take turns, round after round, so a slow moment of the
    machine falls on all of them alike; each rank's figure is its least over the rounds."""
    q, k, v, dout = make_qkv(seq_len, heads, head_dim)
    n = num_chunks(world_size, layout)
    chunks = [t.chunk(n, dim=-2) for t in (q, k, v, dout)]
    best = [float("inf")] * world_size
    for _ in range(rounds):
        for rank in range(world_size):
            best[rank] = min(best[rank], rank_blocks_cpu_s(chunks, rank, world_size, layout))
    return best


def rank_blocks_cpu_s(chunks, rank, world_size, layout):
    """One pass over the blocks `rank` computes (forward then backward of each), timed."""
    q_c, k_c, v_c, dout_c = chunks
    heads, block_tokens, head_dim = q_c[0].shape
    delta = torch.zeros(heads, block_tokens)
    scale = 1.0 / math.sqrt(head_dim)
    work = Work()
    for q_id in chunk_ids(rank, world_size, layout):
        for k_id in range(len(q_c)):
            seen = visible(q_id, k_id, causal=True)
            if seen is None:
                continue
            diagonal = seen == "diagonal"
            _, lse = work.timed(attention_block, q_c[q_id], k_c[k_id], v_c[k_id], scale, diagonal)
            work.timed(block_backward, q_c[q_id], k_c[k_id], v_c[k_id], dout_c[q_id], lse, delta,
                       scale, diagonal)
    return work.cpu_s


def block_costs(block_tokens, heads, head_dim, rounds=7):
    """Thread CPU seconds of one block's forward + backward, (diagonal, full), in this process
    alone. The two kinds take turns, round after round, so a slow moment of the machine falls
    on both alike; each figure is its least over the rounds."""
    q, k, v, dout = make_qkv(block_tokens, heads, head_dim)
    delta = torch.zeros(heads, block_tokens)
    scale = 1.0 / math.sqrt(head_dim)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(rounds):
        for diagonal in best:
            start = time.thread_time()
            _, block_lse = attention_block(q, k, v, scale, diagonal)
            block_backward(q, k, v, dout, block_lse, delta, scale, diagonal)
            best[diagonal] = min(best[diagonal], time.thread_time() - start)
    return best[True], best[False]


def ring_memory(rank, world_size, seq_lens, heads=4, head_dim=16):
    """Bytes saved for backward on this rank, per sequence length (zigzag, causal)."""
    results = {}
    for seq_len in seq_lens:
        q, k, v, _ = make_qkv(seq_len, heads, head_dim)
        local = [shard_sequence(t, rank, world_size, "zigzag").requires_grad_()
                 for t in (q, k, v)]
        results[seq_len] = saved_bytes(lambda: ring_attention(*local, layout="zigzag"))
    return results


def lesson_measurements(rank, world_size, parity_seq, work_shape, memory_seqs, library,
                        traffic_seq=1024):
    """Everything lesson 07 measures on one ring, in one spawn (starting processes is the
    slow part on a laptop)."""
    layouts = ["contiguous", "zigzag"]
    results = {"parity": ring_parity(rank, world_size, parity_seq, layouts),
               # One run per layout, not the least of three: the lesson prints these ring
               # figures and asserts on a replay in one process, which a shared machine moves less.
               "work": ring_work(rank, world_size, *work_shape, layouts, repeats=1),
               "memory": ring_memory(rank, world_size, memory_seqs),
               "traffic": forward_traffic(rank, world_size, traffic_seq)}
    if library:
        results["library"] = try_library_context_parallel(rank, world_size)
    return results


def try_library_context_parallel(rank, world_size, seq_len=64):
    """torch's own CP: context_parallel() shards the buffers and swaps SDPA for ring SDPA.
    Returns what happened on this device: the output's parity, or the error it raised."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    q, k, v, _ = make_qkv(seq_len)
    q, k, v = (t.unsqueeze(0).clone() for t in (q, k, v))  # SDPA wants [batch, heads, seq, dim]
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (full,) = context_parallel_unshard(mesh, [out], [2])
        return {"ran": True, "local_shape": tuple(out.shape),
                "max_abs_diff": (full - expected).abs().max().item()}
    except Exception as exc:  # the lesson shows exactly what the library says
        return {"ran": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
