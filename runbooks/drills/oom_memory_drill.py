"""Drill: where a training step's memory goes, and what each OOM mitigation really saves.

Runbooks: runbooks/oom-mitigations.md, runbooks/oom-distributed-causes.md.

Every mitigation is predicted first (from a byte ledger of the tensors autograd saves, and from
labs/memory_estimator.py for the persistent state), then measured on the lab01 TinyLlama:
- activation bytes vs batch size and sequence length (saved-tensor hooks count them),
- activation checkpointing per block (bytes still held when forward ends),
- bf16 autocast (which does NOT halve activations: the ledger says why),
- gradient accumulation (same effective batch, same gradients, lower peak),
- fully_shard (persistent params + grads + AdamW state per rank, world size 1 vs 2),
- a distributed cause: the full model materialised on every rank before sharding,
- one process group per call, and what creating it costs.

Memory is measured per rank with LiveBytes below: a TorchDispatchMode that sees every tensor an
op creates and a weakref that sees its storage freed. It counts tensor bytes exactly, on any
device; it does not see the allocator's rounding and caching, the CUDA context or NCCL.

Run (CPU + gloo, or GPUs + nccl; a world of one without torchrun):
    python runbooks/drills/oom_memory_drill.py --out /tmp/oom1.json
    torchrun --standalone --nproc-per-node 2 runbooks/drills/oom_memory_drill.py \\
        --out /tmp/oom2.json
Output: one line per measurement, e.g.
    checkpointing | held after forward 7.03 MiB -> 0.75 MiB | predicted cut 6.28 MiB | ...
"""

import argparse
import datetime
import gc
import json
import os
import socket
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
# TorchDispatchMode has no public alias; it is the documented hook for seeing every op.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "labs"))
from labkit.data import SyntheticSequences  # noqa: E402  (the labs' kit: data, TinyLlama, loss)
from labkit.model import build_model, initial_value, loss_fn  # noqa: E402
import memory_estimator  # noqa: E402  (the course's one estimator of persistent state)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oom_host_memory import host_oom_message  # noqa: E402

MiB = 2**20


# ---------------------------------------------------------------- measuring
def tree_tensors(obj):
    """Every tensor inside nested lists, tuples and dicts (an op's args or outputs)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tree_tensors(item)]
    return []


def real_storage(t):
    """The storage that holds t's bytes on this rank: a DTensor's local shard; none for meta
    tensors (shapes only)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return None if t.device.type == "meta" else t.untyped_storage()


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage created inside the context and still alive (`current`), and the
    highest value seen (`peak`). Views and in-place ops reuse an input's storage and are not
    new memory; tensors that existed before the context (parameters, inputs) are not counted."""

    def __init__(self):
        super().__init__()
        self.sizes, self.refs, self.current, self.peak = {}, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s.data_ptr() for s in map(real_storage, tree_tensors((args, kwargs))) if s}
        for storage in map(real_storage, tree_tensors(out)):
            if storage and storage.data_ptr() not in inputs and id(storage) not in self.sizes:
                self._track(storage)
        self.peak = max(self.peak, self.current)
        return out

    def _track(self, storage):
        key = id(storage)
        self.sizes[key] = storage.nbytes()
        self.current += self.sizes[key]
        # The callback runs when the storage itself is freed, not when a view of it dies.
        self.refs[key] = weakref.ref(storage, lambda _ref, key=key: self._free(key))

    def _free(self, key):
        self.current -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)


def saved_tensor_bytes(fn, exclude=()):
    """Run fn() and sum the bytes of distinct storages autograd saves for backward, leaving
    out `exclude` (the parameters: they exist anyway). Returns (fn's result, bytes)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(saved.values())


# ---------------------------------------------------------------- predicting
def activation_ledger(cfg, batch, seq_len, autocast_bf16=False, inputs_counted=True):
    """Bytes autograd saves in one forward of lab01's TinyLlama, tensor by tensor (read off
    the backward formulas of the ops the model calls; the tests hold it to the byte).

    fp32: everything is 4 bytes. bf16 autocast: matmuls and attention run in bf16, but the
    residual stream, the RMSNorm internals, RoPE and the loss stay fp32; every Linear saves
    its own bf16 copy of its input, and a bf16 copy of its weight (cast once per forward)."""
    tokens, dim, heads = batch * seq_len, cfg.dim, cfg.num_heads
    hidden, head_dim = 4 * dim, dim // heads
    low = 2 if autocast_bf16 else 4  # bytes of what autocast computes in bf16
    norm = tokens * (2 * dim + 1) * 4  # RMSNorm: input, rsqrt(mean x^2), x * rsqrt (fp32)
    # input of wq/wk/wv: one shared fp32 tensor, or three separate bf16 casts under autocast
    qkv_inputs = tokens * dim * (3 * low if autocast_bf16 else 4)
    attention = (norm + qkv_inputs
                 + 2 * seq_len * head_dim * 4        # RoPE cos and sin (fp32)
                 + 4 * tokens * dim * low            # SDPA: rotated q, k, v and its output
                 + tokens * heads * 4)               # SDPA logsumexp (fp32)
    w1_w3_inputs = tokens * dim * (2 * low if autocast_bf16 else 4)
    feed_forward = (norm + w1_w3_inputs
                    + 4 * tokens * hidden * low)     # w1 out, silu(w1 out), w3 out, product
    per_block = attention + feed_forward
    head = norm + tokens * dim * low + tokens * cfg.vocab_size * 4  # output in, log_softmax
    head += 4 + (2 * tokens * 8 if inputs_counted else 0)  # nll_loss weight; ids and targets
    linear_numel = cfg.num_layers * 16 * dim * dim + cfg.vocab_size * dim  # 4 attn + 3 ffn (4x)
    weight_copies = 2 * linear_numel if autocast_bf16 else 0
    return {"per_block": per_block, "block_input": tokens * dim * 4, "outside_blocks": head,
            "weight_copies": weight_copies,
            "total": cfg.num_layers * per_block + head + weight_copies}


def predict_held_after_forward(cfg, batch, seq_len, checkpointed):
    """Bytes still allocated when forward returns (inputs already existed; +4 for the loss).
    Checkpointing keeps only each block's input and recomputes the rest in backward."""
    ledger = activation_ledger(cfg, batch, seq_len, inputs_counted=False)
    blocks = ledger["block_input"] if checkpointed else ledger["per_block"]
    return cfg.num_layers * blocks + ledger["outside_blocks"] + 4


# ---------------------------------------------------------------- the model
def build(cfg, device):
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    model.init_weights(cfg.seed)
    return model.to(device)


def make_batch(cfg, batch, seq_len, device, offset=0):
    data = SyntheticSequences(offset + batch, seq_len, cfg.vocab_size, cfg.seed)
    pairs = [data[i] for i in range(offset, offset + batch)]
    return (torch.stack([p[0] for p in pairs]).to(device),
            torch.stack([p[1] for p in pairs]).to(device))


def forward_loss(model, tokens, targets, checkpointed=False, amp_dtype=None):
    """lab01's forward, optionally with each block under non-reentrant checkpointing (the
    variant to use: it composes with fully_shard and with autocast)."""
    with torch.autocast(tokens.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        h = model.tok_embeddings(tokens)
        for block in model.layers.values():
            h = checkpoint(block, h, use_reentrant=False) if checkpointed else block(h)
        logits = model.output(model.norm(h))
    return loss_fn(logits, targets)


def step_seconds(model, tokens, targets, repeats):
    """Least CPU seconds of forward + backward, plain and checkpointed, measured in turns so
    that a busy moment on the machine hits both alike. process_time, not wall time: on a shared
    machine other jobs' load would swamp the recompute cost (on a GPU, time with events)."""
    times = {False: [], True: []}
    for _ in range(repeats):
        for checkpointed in (False, True):
            t0 = time.process_time()
            forward_loss(model, tokens, targets, checkpointed).backward()
            times[checkpointed].append(time.process_time() - t0)
            model.zero_grad(set_to_none=True)
    return {checkpointed: min(found) for checkpointed, found in times.items()}


def step_flops(model, tokens, targets, checkpointed):
    """FLOPs of forward + backward, counted op by op (matmuls and attention)."""
    with FlopCounterMode(display=False) as counter:
        forward_loss(model, tokens, targets, checkpointed).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def predict_recompute_flops(model, tokens):
    """What checkpointing adds: each block's forward again, except its last matmul (w2).
    Non-reentrant checkpointing stops recomputing once it has every tensor backward needs, and
    nothing in backward needs w2's output (the residual add saves nothing)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        h = model.tok_embeddings(tokens)
        for block in model.layers.values():
            h = block(h)
    w2_flops = sum(2 * tokens.numel() * block.feed_forward.w2.in_features
                   * block.feed_forward.w2.out_features for block in model.layers.values())
    return counter.get_total_flops() - w2_flops


# ---------------------------------------------------------------- the measurements
def measure_activation_scaling(cfg, device):
    """Saved bytes for a grid of (batch, seq_len) against the ledger."""
    model = build(cfg, device)
    rows = []
    for batch, seq_len in [(4, 32), (8, 32), (16, 32), (8, 64)]:
        tokens, targets = make_batch(cfg, batch, seq_len, device)
        _, measured = saved_tensor_bytes(lambda: forward_loss(model, tokens, targets),
                                         exclude=list(model.parameters()))
        rows.append({"batch": batch, "seq_len": seq_len, "measured": measured,
                     "predicted": activation_ledger(cfg, batch, seq_len)["total"]})
    return rows


def measure_checkpointing(cfg, device, batch, seq_len, repeats):
    model = build(cfg, device)
    tokens, targets = make_batch(cfg, batch, seq_len, device)
    seconds = step_seconds(model, tokens, targets, repeats)
    result = {"predicted_recompute_flops": predict_recompute_flops(model, tokens)}
    for name, checkpointed in (("plain", False), ("checkpointed", True)):
        with LiveBytes() as live:
            loss = forward_loss(model, tokens, targets, checkpointed)
            held = live.current
            loss.backward()
        model.zero_grad(set_to_none=True)
        result[name] = {"held_after_forward": held, "step_peak": live.peak,
                        "predicted_held": predict_held_after_forward(cfg, batch, seq_len,
                                                                     checkpointed),
                        "fwd_bwd_flops": step_flops(model, tokens, targets, checkpointed),
                        "fwd_bwd_s": seconds[checkpointed]}
    return result


def measure_bf16(cfg, device, batch, seq_len):
    """Saved bytes in fp32 and under bf16 autocast (fp32 weights, bf16 compute): the way
    lab01 trains on GPUs. (A pure-bf16 lab01 model also runs, since apply_rope keeps q and k
    in their input dtype; its saved bytes are not measured here.)"""
    tokens, targets = make_batch(cfg, batch, seq_len, device)
    model = build(cfg, device)
    params = list(model.parameters())
    _, fp32 = saved_tensor_bytes(lambda: forward_loss(model, tokens, targets), params)
    _, bf16 = saved_tensor_bytes(lambda: forward_loss(model, tokens, targets,
                                                      amp_dtype=torch.bfloat16), params)
    return {"fp32": fp32, "autocast_bf16": bf16,
            "predicted_fp32": activation_ledger(cfg, batch, seq_len)["total"],
            "predicted_autocast_bf16": activation_ledger(cfg, batch, seq_len, True)["total"],
            "autocast_weight_copies": activation_ledger(cfg, batch, seq_len, True)["weight_copies"]}


def accumulate_step(model, optimizer, cfg, device, batch, num_micro, offset=0):
    """One optimizer step over `batch` sequences split into num_micro micro-batches. Each
    micro-loss is divided by num_micro, so the summed gradient is the full batch's mean."""
    tokens, targets = make_batch(cfg, batch, cfg.seq_len, device, offset)
    for chunk_tokens, chunk_targets in zip(tokens.chunk(num_micro), targets.chunk(num_micro)):
        (forward_loss(model, chunk_tokens, chunk_targets) / num_micro).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_accumulation(cfg, device, batch, num_micro):
    """Peak of a steady-state step (AdamW state already exists) for the whole batch at once
    and for num_micro micro-batches; plus proof that both compute the same gradients."""
    result = {}
    for micro in (1, num_micro):
        model = build(cfg, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        accumulate_step(model, optimizer, cfg, device, batch, micro)  # creates AdamW state
        with LiveBytes() as live:
            accumulate_step(model, optimizer, cfg, device, batch, micro, offset=batch)
        result[micro] = live.peak
    grads = []
    for micro in (1, num_micro):
        model = build(cfg, device)
        tokens, targets = make_batch(cfg, batch, cfg.seq_len, device)
        for t, y in zip(tokens.chunk(micro), targets.chunk(micro)):
            (forward_loss(model, t, y) / micro).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    held = [predict_held_after_forward(cfg, batch // m, cfg.seq_len, False) for m in (1, num_micro)]
    return {"batch": batch, "num_micro": num_micro, "peak_whole": result[1],
            "peak_accumulated": result[num_micro], "predicted_cut": held[0] - held[1],
            "grad_max_abs_diff": (grads[0] - grads[1]).abs().max().item()}


# ---------------------------------------------------------------- distributed
def local_bytes(tensors):
    """Bytes this rank holds for these tensors (a DTensor counts only its local shard)."""
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def shard_model(model, mesh):
    # Bottom-up: each block is its own unit (all-gathered only while it computes), then the
    # root takes what is left (embeddings, final norm, output).
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build_sharded(cfg, device, mesh, on_meta):
    """The model under fully_shard, built the right way (on the meta device: no memory until
    to_empty allocates this rank's shards) or the common way (full model first, then shard)."""
    if not on_meta:
        model = build(cfg, device)  # every rank materialises the FULL model here
        shard_model(model, mesh)
        return model
    with torch.device("meta"):
        model = build_model(cfg)
    shard_model(model, mesh)
    model.to_empty(device=device)
    with torch.no_grad():  # initialise each shard from the same full values lab01 uses
        for name, param in model.named_parameters():
            full = initial_value(name, param.shape, cfg.seed).to(device)
            param.to_local().copy_(local_rows(full, param))
    return model


def local_rows(full, param):
    """The rows of `full` this rank holds in the Shard(0) DTensor `param`, split as torch.chunk
    splits them (fully_shard's layout). Slicing, not distribute_tensor: a scatter's buffers
    live as long as gloo's work objects do, and the peak would measure them, not the rule."""
    assert tuple(param.placements) == (Shard(0),), param.placements
    rank, chunks = param.device_mesh.get_local_rank(), full.chunk(param.device_mesh.size())
    return chunks[rank] if rank < len(chunks) else full[:0]


def measure_fsdp_state(cfg, device, rank, world_size):
    """Peak bytes while building the sharded model both ways; then the persistent state per
    rank (params, grads, AdamW state after one step) against memory_estimator's zero3 and
    ddp predictions for the same shapes."""
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    build_peak = {}
    for name, on_meta in (("full_then_shard", False), ("meta_then_shard", True)):
        with LiveBytes() as live:
            model = build_sharded(cfg, device, mesh, on_meta)
        build_peak[name] = live.peak
    shapes = [tuple(p.shape) for p in model.parameters()]  # global (unsharded) shapes
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    tokens, targets = make_batch(cfg, cfg.batch_size // world_size, cfg.seq_len, device,
                                 offset=rank * cfg.batch_size)
    # model(...), not forward_loss: the root's forward hook all-gathers the root's own params
    loss_fn(model(tokens), targets).backward()
    grads = local_bytes(p.grad for p in model.parameters())
    optimizer.step()
    states = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    predicted = {}
    for strategy in ("ddp", "zero3"):
        est = memory_estimator.estimate_per_rank(None, world_size, strategy, shapes=shapes)
        predicted[strategy] = {**vars(est), "total_bytes": est.total_bytes}
    return {"params_bytes": local_bytes(model.parameters()), "grads_bytes": grads,
            "optimizer_bytes": local_bytes(states), "num_params": sum(map(_numel, shapes)),
            "predicted": predicted, "build_peak": build_peak, "param_shapes": shapes}


def _numel(shape):
    return int(torch.Size(shape).numel())


def measure_process_groups(device, num_groups):
    """Seconds per collective on one reused group vs creating a new group for each call.
    Every new_group is itself collective (all ranks must call it) and, on NCCL, builds a new
    communicator with its own GPU buffers: leaked groups are leaked device memory."""
    tensor = torch.ones(1024, device=device)
    reused = dist.new_group()
    dist.all_reduce(tensor, group=reused)  # warm up the connection
    dist.barrier()  # start the clocks together, or one rank times the other's lateness
    t0 = time.perf_counter()
    for _ in range(num_groups):
        dist.all_reduce(tensor, group=reused)
    reuse_s = (time.perf_counter() - t0) / num_groups
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(num_groups):
        group = dist.new_group()
        dist.all_reduce(tensor, group=group)
        dist.destroy_process_group(group)  # without this each call leaks a group
    new_s = (time.perf_counter() - t0) / num_groups
    dist.destroy_process_group(reused)
    return {"num_calls": num_groups, "reused_group_s": reuse_s, "new_group_per_call_s": new_s}


# ---------------------------------------------------------------- will it fit?
def predict_step_peak(cfg, batch, seq_len, world_size=1, strategy="ddp"):
    """Peak bytes of one training step on one rank: the persistent state (memory_estimator)
    plus the activations held when forward ends (the ledger). It leaves out backward's
    temporaries, the allocator's rounding and, on GPUs, the CUDA context: hence a margin."""
    num_params = sum(_numel(s) for s in _param_shapes(cfg))
    state = memory_estimator.estimate_per_rank(num_params, world_size, strategy)
    return state.total_bytes + predict_held_after_forward(cfg, batch, seq_len, False)


def _param_shapes(cfg):
    with torch.device("meta"):
        return [tuple(p.shape) for p in build_model(cfg).parameters()]


def verdict(predicted, budget, margin):
    if predicted > budget:
        return "OOM"
    return "fits" if predicted * (1 + margin) <= budget else "too close to call"


def measure_step_peak(cfg, device, batch, seq_len):
    """Measured peak of a steady-state step: what existed before it (params, AdamW state)
    plus the most that was allocated on top during forward, backward and optimizer.step."""
    model = build(cfg, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    fit_cfg = argparse.Namespace(**{**vars(cfg), "seq_len": seq_len})
    accumulate_step(model, optimizer, fit_cfg, device, batch, 1)  # creates AdamW state
    before = local_bytes(list(model.parameters()) + [t for s in optimizer.state.values()
                                                     for t in s.values()])
    with LiveBytes() as live:
        accumulate_step(model, optimizer, fit_cfg, device, batch, 1, offset=batch)
    return before + live.peak


def will_it_fit(cfg, device, batch, seq_len, budget, margin=0.10):
    predicted = predict_step_peak(cfg, batch, seq_len)
    measured = measure_step_peak(cfg, device, batch, seq_len)
    return {"batch": batch, "seq_len": seq_len, "budget": budget, "predicted": predicted,
            "measured": measured, "predicted_verdict": verdict(predicted, budget, margin),
            "measured_verdict": "OOM" if measured > budget else "fits"}


# ---------------------------------------------------------------- the run
class OneLineErrorParser(argparse.ArgumentParser):
    """Bad input: one line on stderr naming the flag, exit status 2 (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None):
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    arg = parser.add_argument
    arg("--batch-size", type=int, default=16, help="sequences per step (global, for fully_shard)")
    arg("--seq-len", type=int, default=32, help="tokens per sequence")
    arg("--dim", type=int, default=64, help="model width")
    arg("--num-layers", type=int, default=2, help="transformer blocks")
    arg("--num-heads", type=int, default=4, help="attention heads")
    arg("--vocab-size", type=int, default=64, help="vocabulary size")
    arg("--num-micro", type=int, default=4, help="micro-batches for the accumulation drill")
    arg("--device", choices=["cpu", "cuda"], default="cpu",
        help="cuda needs one GPU per local rank (the drill then uses nccl)")
    arg("--timeout-s", type=float, default=60.0, help="seconds any collective may block")
    arg("--out", default="", help="write every measurement as JSON here (rank 0)")
    cfg = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    for name in ("batch_size", "seq_len", "dim", "num_layers", "num_heads", "vocab_size",
                 "num_micro", "timeout_s"):
        if getattr(cfg, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if cfg.batch_size % (world_size * cfg.num_micro):
        parser.error(f"--batch-size must be divisible by world size x --num-micro "
                     f"({world_size} x {cfg.num_micro})")
    if cfg.dim % cfg.num_heads or (cfg.dim // cfg.num_heads) % 2:
        parser.error("--dim must split into --num-heads even-sized heads")
    cfg.seed, cfg.lr = 0, 3e-3
    # The rest of lab01's model config, as its debug preset has it: no grouped-query attention,
    # a SwiGLU width of 4 x dim (what activation_ledger counts), RoPE base 10000.
    cfg.num_kv_heads, cfg.ffn_dim, cfg.rope_theta = cfg.num_heads, 4 * cfg.dim, 1e4
    return cfg


def init_distributed(cfg):
    if "RANK" not in os.environ:  # plain python: a world of one
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if cfg.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # before any CUDA work: see oom-distributed-causes.md
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def run_all(cfg, rank, world_size, device):
    batch = cfg.batch_size // world_size  # this rank's share of the global batch
    fit_budgets = [int(f * predict_step_peak(cfg, batch, cfg.seq_len)) for f in (0.8, 1.25)]
    return {
        "world_size": world_size, "device": device.type, "torch_version": torch.__version__,
        "config": vars(cfg),
        "activation_scaling": measure_activation_scaling(cfg, device),
        "checkpointing": measure_checkpointing(cfg, device, batch, cfg.seq_len, repeats=7),
        "bf16": measure_bf16(cfg, device, batch, cfg.seq_len),
        "accumulation": measure_accumulation(cfg, device, batch, cfg.num_micro),
        "fsdp": measure_fsdp_state(cfg, device, rank, world_size),
        "process_groups": measure_process_groups(device, num_groups=3),
        "will_it_fit": [will_it_fit(cfg, device, batch, cfg.seq_len, b) for b in fit_budgets],
        "host_oom": host_oom_message(),  # the look-alike: host RAM, not the GPU
    }


def report_lines(r):
    ck, bf, acc, fs = r["checkpointing"], r["bf16"], r["accumulation"], r["fsdp"]
    plain, ac = ck["plain"], ck["checkpointed"]
    state = fs["params_bytes"] + fs["grads_bytes"] + fs["optimizer_bytes"]
    lines = [f"activations | batch {row['batch']:3d} seq {row['seq_len']:3d} | saved "
             f"{row['measured'] / MiB:.2f} MiB | predicted {row['predicted'] / MiB:.2f} MiB"
             for row in r["activation_scaling"]]
    lines += [
        f"checkpointing | held after forward {plain['held_after_forward'] / MiB:.2f} MiB -> "
        f"{ac['held_after_forward'] / MiB:.2f} MiB | predicted cut "
        f"{(plain['predicted_held'] - ac['predicted_held']) / MiB:.2f} MiB | measured cut "
        f"{(plain['held_after_forward'] - ac['held_after_forward']) / MiB:.2f} MiB | "
        f"fwd+bwd x{ac['fwd_bwd_flops'] / plain['fwd_bwd_flops']:.2f} FLOPs (recomputed "
        f"{ac['fwd_bwd_flops'] - plain['fwd_bwd_flops']:,}, predicted "
        f"{ck['predicted_recompute_flops']:,}), x{ac['fwd_bwd_s'] / plain['fwd_bwd_s']:.2f} "
        f"CPU time",
        f"bf16 autocast | saved {bf['fp32'] / MiB:.2f} MiB -> {bf['autocast_bf16'] / MiB:.2f} MiB "
        f"(x{bf['autocast_bf16'] / bf['fp32']:.2f}) | predicted "
        f"{bf['predicted_autocast_bf16'] / MiB:.2f} MiB",
        f"accumulation | batch {acc['batch']} in 1 vs {acc['num_micro']} micro-batches | peak "
        f"{acc['peak_whole'] / MiB:.2f} MiB -> {acc['peak_accumulated'] / MiB:.2f} MiB | "
        f"predicted cut {acc['predicted_cut'] / MiB:.2f} MiB | grads differ by "
        f"{acc['grad_max_abs_diff']:.1e}",
        f"fully_shard | world {r['world_size']} | params+grads+adamw per rank "
        f"{state / MiB:.3f} MiB | predicted zero3 "
        f"{fs['predicted']['zero3']['total_bytes'] / MiB:.3f} MiB | ddp "
        f"{fs['predicted']['ddp']['total_bytes'] / MiB:.3f} MiB",
        f"building under fully_shard | peak {fs['build_peak']['full_then_shard']:,} bytes "
        f"(full model first) vs {fs['build_peak']['meta_then_shard']:,} bytes (meta device) | "
        f"full model {4 * fs['num_params']:,} bytes, shard {fs['params_bytes']:,} bytes",
        f"process groups | reused {r['process_groups']['reused_group_s'] * 1e3:.2f} ms/call | new "
        f"group per call {r['process_groups']['new_group_per_call_s'] * 1e3:.2f} ms/call",
    ]
    lines.append(f"host memory | {r['host_oom']}")
    lines += [f"will it fit | budget {f['budget'] / MiB:.2f} MiB | predicted peak "
              f"{f['predicted'] / MiB:.2f} MiB -> {f['predicted_verdict']} | measured peak "
              f"{f['measured'] / MiB:.2f} MiB -> {f['measured_verdict']}" for f in r["will_it_fit"]]
    return lines


def main(argv=None):
    cfg = parse_args(argv)
    rank, world_size, device = init_distributed(cfg)
    try:
        results = run_all(cfg, rank, world_size, device)
        if rank == 0:
            print("\n".join(report_lines(results)), flush=True)
            if cfg.out:
                Path(cfg.out).write_text(json.dumps(results, indent=2))
        dist.barrier()
    finally:
        gc.collect()  # the sharded models lived inside run_all(): free them before the group
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
