"""Worker functions for lesson 00 (processes, ranks and collectives).

Each worker is `fn(rank, world_size, *args)` and runs inside a gloo process group that
lessons/spawn.py has already started; what it returns comes back to the notebook. They live in
a module, not in notebook cells, because each child process imports them by name (see
lessons/spawn.py).

The file is also a torchrun script, so the lesson can show what torchrun really starts:
    torchrun --standalone --nproc-per-node 2 lessons/collective_workers.py --out env.json
Imports: stdlib and torch only (matplotlib only inside the drawing helper).
"""

import argparse
import datetime
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
# Gloo learned ReduceOp.AVG (pytorch PR #149781) and the list form of reduce_scatter
# (PR #149869) in March 2025, so torch 2.8 (inferred from the merge dates). NCCL has both on
# every supported torch. Older gloo gets what those PRs do internally: SUM, then divide.
GLOO_HAS_AVG_AND_REDUCE_SCATTER = TORCH_VERSION >= (2, 8)

# torch 2.13 renamed the flat-buffer forms (all_gather_into_tensor -> all_gather_single,
# reduce_scatter_tensor -> reduce_scatter_single); the old names still work but warn, and the
# new names do not exist before 2.13. Pick whichever this torch has.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)

TORCHRUN_ENV = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS"]


# ---- processes, ranks and the rendezvous store ------------------------------------------
def describe_process(rank, world_size):
    """What one rank knows about itself, and a round trip through the rendezvous store.

    init_process_group("env://") made rank 0 host a TCPStore (a key-value server) at
    MASTER_ADDR:MASTER_PORT (under torchrun its agent hosts it instead) and every rank connect
    to it; that is how ranks that know nothing but one address find each other. Here each rank
    connects as one more client, writes a key and waits for everyone else's.
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=30))
    store.set(f"lesson00/pid/{rank}", str(os.getpid()))
    keys = [f"lesson00/pid/{r}" for r in range(world_size)]
    store.wait(keys, datetime.timedelta(seconds=30))  # blocks until every rank has written
    pids_seen = [int(store.get(key)) for key in keys]
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "pid": os.getpid(),
            "env": {name: os.environ.get(name) for name in ["RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT"]},
            "pids_seen": pids_seen}


# ---- every collective the course uses, on small tensors -----------------------------------
def rank_values(rank, numel):
    """Rank r holds 10r, 10r+1, ...: the tens digit says where a value came from."""
    return torch.arange(numel, dtype=torch.float32) + 10 * rank


def all_reduce_avg(tensor):
    if dist.get_backend() != "gloo" or GLOO_HAS_AVG_AND_REDUCE_SCATTER:
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor.div_(dist.get_world_size())


def reduce_scatter_list(output, input_list):
    if dist.get_backend() != "gloo" or GLOO_HAS_AVG_AND_REDUCE_SCATTER:
        dist.reduce_scatter(output, input_list, op=dist.ReduceOp.SUM)
    else:  # older gloo: the flat-buffer form, which gloo has supported longer
        reduce_scatter_single(output, torch.cat(input_list), op=dist.ReduceOp.SUM)


def run_collectives(rank, world_size, numel=4):
    """Run each collective once; return {name: (before, after)} as this rank saw it, plus
    the barrier timings and any warnings from the pre-2.13 flat-buffer names."""
    n = world_size
    out = {}

    x = rank_values(rank, numel)
    before = x.clone()
    dist.broadcast(x, src=0)                      # everyone gets rank 0's tensor
    out["broadcast"] = (before, x)

    x = rank_values(rank, numel)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)      # everyone gets the elementwise sum
    out["all_reduce_sum"] = (rank_values(rank, numel), x)

    x = rank_values(rank, numel)
    all_reduce_avg(x)                             # ... or the mean (DDP's gradient average)
    out["all_reduce_avg"] = (rank_values(rank, numel), x)

    x = rank_values(rank, numel)
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)   # only rank 0's result is defined
    out["reduce"] = (rank_values(rank, numel), x if rank == 0 else None)

    gathered = [torch.empty(numel) for _ in range(n)]
    dist.all_gather(gathered, rank_values(rank, numel))   # everyone gets every rank's tensor
    out["all_gather"] = (rank_values(rank, numel), torch.cat(gathered))

    chunks = list(rank_values(rank, n).chunk(n))          # chunk i is meant for rank i
    mine = torch.empty(1)
    reduce_scatter_list(mine, chunks)                     # rank i gets sum of everyone's chunk i
    out["reduce_scatter"] = (rank_values(rank, n), mine)

    send = rank_values(rank, n)                           # element j is meant for rank j
    received = torch.empty(n)
    dist.all_to_all_single(received, send)                # rank i gets element i of everyone
    out["all_to_all"] = (send, received)

    x, incoming = rank_values(rank, numel), torch.empty(numel)
    exchange(x, incoming, dst=(rank + 1) % n, src=(rank - 1) % n)   # pass it to the right
    out["send_recv"] = (x, incoming)
    out.update(run_flat_forms(rank, world_size, numel))
    out["barrier"] = barrier_timing(rank, world_size)
    return out


def run_flat_forms(rank, world_size, numel):
    """The flat-buffer forms (one tensor in, one out, no Python list): what FSDP uses, since
    NCCL can then write straight into one contiguous buffer."""
    n = world_size
    flat = torch.empty(n * numel)
    all_gather_single(flat, rank_values(rank, numel))
    mine = torch.empty(1)
    reduce_scatter_single(mine, rank_values(rank, n))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.all_gather_into_tensor(torch.empty(n * numel), rank_values(rank, numel))
    return {"all_gather_flat": (rank_values(rank, numel), flat),
            "reduce_scatter_flat": (rank_values(rank, n), mine),
            "old_name_warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


# ---- groups of ranks, and a collective left running ----------------------------------------
def groups_and_async(rank, world_size, numel=2**20):
    """Two sub-groups of 2 ranks each, an all-reduce inside each; then an all-reduce issued
    with async_op=True, a matmul while it runs, and the wait. Needs world_size 4."""
    # Every rank creates every group, in the same order, even the groups it is not in.
    # new_group does not take the default group's timeout: pass one (runbooks: collective-timeout).
    timeout = datetime.timedelta(seconds=60)
    pairs = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
    mine = pairs[rank // 2]
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=mine)                     # only the 2 ranks of `mine` take part
    out = {"group_ranks": dist.get_process_group_ranks(mine), "group_sum": x.item()}

    big = torch.full((numel,), float(rank))
    start = time.perf_counter()
    work = dist.all_reduce(big, async_op=True)         # returns at once, with a handle
    issued = time.perf_counter()
    torch.randn(256, 256) @ torch.randn(256, 256)      # this rank's own work meanwhile
    work.wait()                                        # now `big` holds the sum
    out["async"] = {"issued_s": issued - start, "done_s": time.perf_counter() - start,
                    "sum_ok": bool(torch.all(big == sum(range(world_size))))}
    return out


# ---- bytes each rank puts on the wire -----------------------------------------------------
def bytes_written():
    """Bytes this process has written so far, sockets included (Linux's /proc/self/io
    "wchar"): gloo sends with plain writes, so the difference around one collective is what
    this rank sent. None where there is no /proc (macOS)."""
    io = Path("/proc/self/io")
    if not io.exists():
        return None
    return int(next(line for line in io.read_text().splitlines()
                    if line.startswith("wchar")).split()[1])


def bytes_sent_per_collective(rank, world_size, shard_numel=2**18):
    """{collective: bytes this rank sent / bytes of the full tensor S}, for one call each on
    S = world_size x shard_numel fp32 values (the gathered size, for all-gather and
    reduce-scatter). None without /proc."""
    full, shard = torch.ones(world_size * shard_numel), torch.empty(shard_numel)
    calls = {"all_reduce": lambda: dist.all_reduce(full),
             "all_gather": lambda: all_gather_single(full, shard),
             "reduce_scatter": lambda: reduce_scatter_single(shard, full)}
    sent = {}
    for name, call in calls.items():
        dist.barrier()  # nobody is still sending the previous call's bytes
        before = bytes_written()
        call()
        sent[name] = None if before is None else (bytes_written() - before) / full.nbytes
    return sent


def barrier_timing(rank, world_size, stagger_s=0.3):
    """Ranks arrive at the barrier at different times; nobody leaves before the last arrives."""
    dist.barrier()                                # line up first, so the stagger is the only skew
    time.sleep(stagger_s * rank)
    arrived = time.time()                         # wall clock: comparable across processes here
    dist.barrier()
    left = time.time()
    return {"arrived": arrived, "left": left}


# ---- ring all-reduce from point-to-point messages -----------------------------------------
def exchange(send_tensor, recv_tensor, dst, src):
    """Send to dst while receiving from src. isend does not block, so when every rank of a
    ring does this at once nobody waits for a receiver that is itself stuck in a send."""
    request = dist.isend(send_tensor, dst)
    dist.recv(recv_tensor, src)
    request.wait()
    return send_tensor.numel() * send_tensor.element_size()


def ring_all_reduce(tensor, on_step=None):
    """Sum `tensor` over all ranks, in place, with a ring; return the bytes this rank sent.

    Phase 1 (reduce-scatter): n-1 steps; at step s rank r sends chunk (r - s) to its right
    neighbour and adds the chunk (r - s - 1) arriving from its left. Afterwards rank r owns
    the full sum of chunk (r + 1). Phase 2 (all-gather): n-1 more steps pass the finished
    chunks around the ring. Each step moves one chunk (S/n bytes) per rank: 2(n-1)/n * S.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(n)     # views: writing a chunk writes the tensor
    right, left = (rank + 1) % n, (rank - 1) % n
    scratch = torch.empty_like(chunks[0])        # tensor_split puts the larger chunks first
    sent = 0
    for step in range(n - 1):
        send_idx, recv_idx = (rank - step) % n, (rank - step - 1) % n
        incoming = scratch[: chunks[recv_idx].numel()]
        sent += exchange(chunks[send_idx], incoming, right, left)
        chunks[recv_idx].add_(incoming)
        if on_step:
            on_step()
    for step in range(n - 1):
        send_idx, recv_idx = (rank + 1 - step) % n, (rank - step) % n
        sent += exchange(chunks[send_idx], chunks[recv_idx], right, left)
        if on_step:
            on_step()
    return sent


def check_ring(rank, world_size, numel=1000, seed=0):
    """Hand-written ring vs dist.all_reduce on the same random inputs."""
    data = torch.randn(numel, generator=torch.Generator().manual_seed(seed + rank))
    by_hand, by_library = data.clone(), data.clone()
    bytes_sent = ring_all_reduce(by_hand)
    dist.all_reduce(by_library)
    ints = torch.randint(-1000, 1000, (numel,), generator=torch.Generator().manual_seed(rank))
    ints_by_hand, ints_by_library = ints.clone(), ints.clone()
    ring_all_reduce(ints_by_hand)                # integers: sums are exact, so must be equal
    dist.all_reduce(ints_by_library)
    # A tiny tensor whose digits say who contributed: rank r starts with 10**r everywhere,
    # so 1101 means "ranks 0, 2 and 3 are in this sum".
    digits = torch.full((world_size,), 10.0 ** rank, dtype=torch.float64)
    trace = [digits.clone()]
    ring_all_reduce(digits, on_step=lambda: trace.append(digits.clone()))
    return {"max_abs_diff": (by_hand - by_library).abs().max().item(),
            "ints_equal": torch.equal(ints_by_hand, ints_by_library),
            "bytes_sent": bytes_sent, "bytes_total": data.numel() * data.element_size(),
            "trace": trace}


# ---- how the strategies of the next lessons use these collectives -------------------------
def make_problem(seed=0, dim=8, hidden=24, batch=12):
    """The same weights and data on every rank (same seed), float64 so diffs are ~1e-15.
    hidden and batch divide by 2, 3 and 4: these hand-written shards must be even (real FSDP
    pads uneven ones)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(hidden, dim, generator=g, dtype=torch.float64)
    w2 = torch.randn(dim, hidden, generator=g, dtype=torch.float64)
    x = torch.randn(batch, dim, generator=g, dtype=torch.float64)
    return w1, w2, x


def mlp(x, w1, w2):
    return F.gelu(x @ w1.T) @ w2.T


def ddp_pattern(rank, n, w1, w2, x):
    """DDP: full weights everywhere, each rank a slice of the batch, all-reduce(AVG) grads."""
    w1 = w1.clone().requires_grad_()
    mlp(x.chunk(n)[rank], w1, w2).square().mean().backward()
    grad = w1.grad
    all_reduce_avg(grad)                         # the one collective DDP adds
    w1_ref = w1.detach().clone().requires_grad_()
    mlp(x, w1_ref, w2).square().mean().backward()   # one process, the whole batch
    return (grad - w1_ref.grad).abs().max().item()


def fsdp_pattern(rank, n, w1, w2, x):
    """FSDP: each rank stores 1/n of w1; all-gather it to compute, reduce-scatter the grad."""
    shard = w1.chunk(n)[rank].clone()            # the only copy this rank keeps between steps
    pieces = [torch.empty_like(shard) for _ in range(n)]
    dist.all_gather(pieces, shard)               # unshard just before use
    full = torch.cat(pieces).requires_grad_()
    mlp(x.chunk(n)[rank], full, w2).square().mean().backward()
    grad_shard = torch.empty_like(shard)
    reduce_scatter_list(grad_shard, list(full.grad.chunk(n)))   # sum; rank r keeps chunk r
    grad_shard /= n
    w1_ref = w1.clone().requires_grad_()
    mlp(x, w1_ref, w2).square().mean().backward()
    return (grad_shard - w1_ref.grad.chunk(n)[rank]).abs().max().item()


def tp_pattern(rank, n, w1, w2, x):
    """Tensor parallel MLP (Megatron style): w1 split by output rows (column parallel),
    w2 split by input columns (row parallel); one all-reduce of partial outputs per MLP."""
    h = F.gelu(x @ w1.chunk(n, dim=0)[rank].T)   # this rank's slice of the hidden units
    partial = h @ w2.chunk(n, dim=1)[rank].T     # a partial sum of the full output
    dist.all_reduce(partial)
    h_pieces = [torch.empty_like(h) for _ in range(n)]
    dist.all_gather(h_pieces, h)                 # column parallel alone: gather the slices
    full_h = torch.cat(h_pieces, dim=1)
    return max((partial - mlp(x, w1, w2)).abs().max().item(),
               (full_h - F.gelu(x @ w1.T)).abs().max().item())


def pp_pattern(rank, n, x, seed=0):
    """Pipeline: rank r owns layer r; activations go forward with send / recv."""
    layers = [torch.randn(x.shape[1], x.shape[1], dtype=torch.float64,
                          generator=torch.Generator().manual_seed(seed + i)) for i in range(n)]
    act = x if rank == 0 else torch.empty_like(x)   # recv needs the shape in advance
    if rank > 0:
        dist.recv(act, src=rank - 1)
    act = torch.tanh(act @ layers[rank])
    if rank < n - 1:
        dist.send(act, dst=rank + 1)
        return 0.0
    ref = x
    for layer in layers:                         # the last stage checks against one process
        ref = torch.tanh(ref @ layer)
    return (act - ref).abs().max().item()


def strategy_patterns(rank, world_size):
    w1, w2, x = make_problem()
    assert w1.shape[0] % world_size == 0 and x.shape[0] % world_size == 0, "uneven shards"
    diffs = {"DDP": ddp_pattern(rank, world_size, w1, w2, x),
             "FSDP": fsdp_pattern(rank, world_size, w1, w2, x),
             "TP": tp_pattern(rank, world_size, w1, w2, x),
             "PP": pp_pattern(rank, world_size, x)}
    worst = torch.tensor(list(diffs.values()), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst rank, for every pattern
    return dict(zip(diffs, worst.tolist()))


# ---- time vs message size ------------------------------------------------------------------
def time_all_reduce(rank, world_size, sizes_bytes, repeats=25, budget_s=0.002):
    """Seconds per dist.all_reduce of float32 tensors, for each size: the fastest of
    `repeats` timed windows, each the slowest rank's average over enough calls to last about
    budget_s. Every pass times every size once, and the minimum is kept: on a shared machine
    a slow window measures the other programs, not the collective, and interleaving spreads
    such moments over all sizes instead of spoiling one."""
    tensors = [torch.ones(size // 4) for size in sizes_bytes]
    calls = []
    for x in tensors:
        for _ in range(3):                       # warm-up: connections, allocator, caches
            dist.all_reduce(x)
        start = time.perf_counter()
        dist.all_reduce(x)
        probe = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)   # every rank must make the same calls
        calls.append(max(2, min(200, int(budget_s / probe.item()))))
    best = [float("inf")] * len(tensors)
    for _ in range(repeats):
        for i, (x, count) in enumerate(zip(tensors, calls)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(count):
                dist.all_reduce(x)
            elapsed = torch.tensor([(time.perf_counter() - start) / count])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # a collective ends on its slowest rank
            best[i] = min(best[i], elapsed.item())
    return list(zip(sizes_bytes, best))


# ---- pictures -------------------------------------------------------------------------------
def cell_color(value, mode, num_ranks):
    """origin: the tens digit names the source rank; reduced: grey (a sum of several ranks);
    digits: darker the more ranks are in the sum (values built from 10**rank)."""
    import matplotlib.pyplot as plt

    if mode == "reduced":
        return "0.8"
    if mode == "digits":
        contributors = sum(ch == "1" for ch in str(int(value)))
        return plt.get_cmap("Blues")(0.25 + 0.75 * contributors / num_ranks)
    return plt.get_cmap("tab10").colors[int(value) // 10 % 10]


def draw_ranks(title, panels):
    """What each rank holds, side by side: panels = [(label, rows, mode), ...], one row per
    rank, one box per element; a row that is None is hatched (undefined after the call)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Rectangle

    num_ranks = len(panels[0][1])
    widths = [max(len(row) for row in rows if row is not None) for _, rows, _ in panels]
    fig, axes = plt.subplots(1, len(panels), squeeze=False, width_ratios=[w + 1.5 for w in widths],
                             figsize=(0.34 * sum(w + 1.5 for w in widths) + 0.3,
                                      0.3 * num_ranks + 0.75))
    for ax, (label, rows, mode), width in zip(axes[0], panels, widths):
        for r, row in enumerate(rows):
            ax.text(-0.6, r, f"rank {r}", ha="right", va="center", fontsize=7)
            if row is None:
                ax.add_patch(Rectangle((-0.5, r - 0.4), width, 0.8, fill=False, hatch="//",
                                       edgecolor="0.6"))
                continue
            for i, value in enumerate(row.tolist()):
                color = to_rgb(cell_color(value, mode, num_ranks))
                ax.add_patch(Rectangle((i - 0.5, r - 0.4), 1, 0.8, edgecolor="white",
                                       facecolor=color))
                dark = 0.3 * color[0] + 0.6 * color[1] + 0.1 * color[2] < 0.5
                ax.text(i, r, f"{value:g}", ha="center", va="center", fontsize=6.5,
                        color="white" if dark else "black")
        ax.set_xlim(-2.0, width - 0.5)             # room on the left for the rank labels
        ax.set_ylim(num_ranks - 0.5, -0.5)
        ax.set_title(label, fontsize=8)
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(w_pad=0.2)
    return fig


# ---- torchrun entry point -------------------------------------------------------------------
def main():
    parser = argparse.ArgumentParser(description="Show what torchrun gives each process.")
    parser.add_argument("--out", default="", help="rank 0 writes every rank's view here (JSON)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="seconds a collective may block before it raises")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        print(f"{sys.argv[0]}: error: start me with torchrun (RANK is not set)", file=sys.stderr)
        sys.exit(2)
    local_rank = int(os.environ["LOCAL_RANK"])
    timeout = datetime.timedelta(seconds=args.timeout_s)
    # The labs' rule: cuda + nccl when every local rank has its own GPU, else cpu + gloo.
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)            # before init: NCCL binds to this device
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    try:
        view = {"pid": os.getpid(), "host": socket.gethostname(), "device": str(device),
                "backend": dist.get_backend(),
                "env": {name: os.environ.get(name) for name in TORCHRUN_ENV}}
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, view)      # pickled objects, through the same backend
        total = torch.tensor([float(dist.get_rank())], device=device)
        dist.all_reduce(total)
        print(f"rank {dist.get_rank()}/{dist.get_world_size()} pid {os.getpid()} "
              f"{dist.get_backend()} sum of ranks {total.item():g}", flush=True)
        if dist.get_rank() == 0 and args.out:
            with open(args.out, "w") as f:
                json.dump({"ranks": views, "sum_of_ranks": total.item()}, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
