"""The model every lab trains: a small Llama-style decoder (RMSNorm, RoPE attention with
grouped-query heads, SwiGLU), its size presets, its initial values, and its FLOPs per token."""

import functools
import math
import zlib
from fnmatch import fnmatch

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import distribute_tensor
from torch.utils.checkpoint import checkpoint

# Llama-shaped sizes. debug is what every test and lesson trains (a CPU step in milliseconds).
# 1b has Llama-3.2-1B's shape but an untied output layer (1.50B parameters, not 1.24B); 8b has
# Llama-3.1-8B's dimensions (8.03B) and 70b Llama-3.1-70B's (70.55B, for --plan). Fields left
# as None follow from the others: num_kv_heads = num_heads (no grouped-query attention),
# ffn_dim = 4 x dim.
MODEL_PRESETS = {
    "debug": dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=None, ffn_dim=None,
                  vocab_size=64, seq_len=32, micro_batch_size=8, rope_theta=1e4),
    "small": dict(dim=256, num_layers=4, num_heads=8, num_kv_heads=4, ffn_dim=768,
                  vocab_size=256, seq_len=256, micro_batch_size=8, rope_theta=1e4),
    "1b": dict(dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, ffn_dim=8192,
               vocab_size=128256, seq_len=2048, micro_batch_size=4, rope_theta=5e5),
    "8b": dict(dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
               vocab_size=128256, seq_len=8192, micro_batch_size=1, rope_theta=5e5),
    "70b": dict(dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672,
                vocab_size=128256, seq_len=8192, micro_batch_size=1, rope_theta=5e5),
}


def initial_value(name, shape, seed):
    """Initial value of one parameter, keyed by its name: the same on every rank, whatever
    the parallel layout, so sharded and pipelined labs can build it piece by piece."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = 0.02 if "embeddings" in name else 1.0 / math.sqrt(shape[-1])
    return torch.randn(shape, generator=generator) * std


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # In fp32, as Meta's Llama does: in fp16 the backward of rsqrt at a small mean square
        # (embeddings of std 0.02) exceeds 65504 and the gradient becomes inf. A no-op in fp32.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(seq_len, head_dim, device, theta):
    """Rotary-embedding cos/sin, computed per call: no buffers, so DDP has none to broadcast."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)  # fp32 tables must not upcast bf16 q/k


class Attention(nn.Module):
    def __init__(self, dim, num_heads, num_kv_heads, rope_theta):
        super().__init__()
        self.head_dim, self.rope_theta = dim // num_heads, rope_theta
        kv_dim = num_kv_heads * self.head_dim  # grouped-query attention: fewer k/v heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_dim, bias=False)
        self.wv = nn.Linear(dim, kv_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        bsz, seq_len, _ = x.shape
        # -1 heads: tensor parallel shards wq/wk/wv by heads, and this still works unchanged.
        q, k, v = (w(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        cos, sin = rope_tables(seq_len, self.head_dim, x.device, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    """Llama-style decoder. Layers live in a ModuleDict keyed by index, so a pipeline stage can
    delete the others (and set tok_embeddings / norm / output to None) without renaming."""

    def __init__(self, cfg):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed):
        for name, param in self.named_parameters():
            param.copy_(initial_value(name, param.shape, seed))


def loss_fn(logits, targets):
    """Next-token cross-entropy, in fp32 at least (bf16 logits lose the loss's precision;
    float64 stays float64 for --parity-dtype float64)."""
    logits = logits.flatten(0, 1)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                           targets.flatten())


def build_model(cfg):
    """TinyLlama in fp32, or in float64 for `--check-parity --parity-dtype float64` (then the
    parallel run and its single-process reference both run in it; see labkit/parity.py)."""
    model = TinyLlama(cfg)
    if getattr(cfg, "check_parity", False) and getattr(cfg, "parity_dtype", "") == "float64":
        model.to(torch.float64)
    return model


def parameter_shapes(cfg):
    """{name: shape} of build_model(cfg), built on the meta device: no memory, any size."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in build_model(cfg).named_parameters()}


def flops_per_token(cfg, seq_len):
    """Training FLOPs per token: 6 per matmul weight (2 forward, 4 backward; the embedding is
    a lookup and the norms' weights scale elementwise, so both are left out), plus attention's
    QK^T and AV, 12 x layers x heads x head_dim x seq_len (PaLM, arXiv:2204.02311, appendix B;
    causal masking is not subtracted, as in torchtitan). With the actual sequence length."""
    shapes = parameter_shapes(cfg)
    matmul_params = sum(math.prod(s) for n, s in shapes.items()
                        if len(s) == 2 and "embeddings" not in n)
    return 6 * matmul_params + 12 * cfg.num_layers * cfg.dim * seq_len


# Per-block model transforms for the FSDP labs (--activation-checkpointing, --compile; the flags
# come from labkit/flags.py's make_parser(block_options=True)). Both act in place, before
# sharding, so parameter names stay those of the single-process model.
def apply_activation_checkpointing(model):
    # torch.utils.checkpoint, non-reentrant: store only each block's input, recompute the rest
    # in backward. Wrapping forward in place (not in a wrapper module) keeps parameter names,
    # so init, checkpoints and the single-process reference all agree.
    for block in model.layers.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def apply_compile(model, backend):
    # Per block, in place: the blocks are identical, so one compiled graph is reused, and the
    # FSDP hooks added later stay outside it (they are dynamo-disabled, graph breaks are fine).
    for block in model.layers.values():
        block.compile(backend=backend)


def apply_block_options(model, cfg):
    """--activation-checkpointing and --compile, per block, in place, before sharding."""
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.compile:
        apply_compile(model, cfg.compile_backend)


# Filling a model that was sharded on the meta device.
@torch.no_grad()
def init_sharded_weights(model, seed):
    """Fill each rank's shards with the values a single process would have, on any mesh and
    placements: FSDP's, TP's, or both (FSDP over TP shards a TP shard again, a strided layout
    that distribute_tensor knows). Trade-off: every rank computes one full parameter at a time
    and keeps its slice (src_data_rank=None: no communication; extra memory: the largest
    parameter; CPU work repeated on every rank). Without src_data_rank=None, distribute_tensor
    would scatter rank 0's copy instead (one compute, one collective per parameter). A real
    large model skips both: it loads its shards from a DCP checkpoint."""
    for name, param in model.named_parameters():
        full = initial_value(name, param.shape, seed).to(param.device, param.dtype)
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())


# A tensor-parallel plan's keys name submodules (lab03, lab05).
def check_plan_keys(module, plan):
    """parallelize_module only warns about a key that matches no submodule, and leaves that
    layer whole on every rank: memory silently not saved, or a shape error far from the typo."""
    names = [name.split(".") for name, _ in module.named_modules() if name]
    for key in plan:
        tokens = key.split(".")  # matched token by token with fnmatch, as parallelize_module does
        if not any(len(n) == len(tokens) and all(map(fnmatch, n, tokens)) for n in names):
            raise ValueError(f"TP plan key {key!r} matches no submodule of "
                             f"{type(module).__name__}")
