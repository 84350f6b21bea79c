"""The self-checks of the onboarding exercise book (docs/onboarding-exercises.md).

Each exercise's self-check block on the page is one call here, `check_N_M(...)`, given the
names the exercise asks for. The reference computations live in this module, not on the page:
a check block that showed them would also show how to get the answer, and pasting it would
pass. A check ends silently when the answer is right and raises AssertionError when it is
not, with a message that says what is wrong without giving the expected value away.

Usage, from the repository root, after your answer:

    import sys
    sys.path.insert(0, "exercises")
    import selfcheck

    selfcheck.check_0_1(ring_bytes_sent)

tests/test_onboarding.py runs every worked answer and every typical wrong answer of the page
against these checks.
"""

import contextlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The references are the course's own code: the lesson helpers and the labs (with labkit).
sys.path[:0] = [str(REPO / "lessons"), str(REPO / "labs")]


def require(ok, message):
    """Raise AssertionError (what the page promises) even under `python -O`."""
    if not ok:
        raise AssertionError(message)


def close(value, want, rel=1e-9):
    return abs(value - want) <= rel * abs(want)


@contextlib.contextmanager
def fake_world(rank, world_size):
    """This process plays `rank` of `world_size` on torch's fake process group (a test utility
    shipped with torch): the real code path runs, no data moves."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ lesson 00: collectives
def check_0_1(ring_bytes_sent):
    """ring_bytes_sent(numel, n, rank) equals what the lesson's ring_all_reduce sends."""
    import torch

    import collective_workers

    for numel, n in [(1000, 4), (1001, 3), (10, 4), (7, 8)]:
        for rank in range(n):
            # One process plays each rank in turn: the lesson's own ring runs, no data moves.
            with fake_world(rank, n):
                sent = collective_workers.ring_all_reduce(torch.zeros(numel))
            require(ring_bytes_sent(numel, n, rank) == sent,
                    f"ring_bytes_sent({numel}, {n}, {rank}) is not what rank {rank} sends: "
                    "which chunk does it send at each step, and how large is that chunk?")


def check_0_2(t2, algbw8, t8):
    """The 2-rank time, and the 8-rank algorithm bandwidth and time, at 0.20 GB/s busbw."""
    import comm_bench

    size, busbw = 16 * 2**20, 0.20e9
    for name, n, seconds in [("t2", 2, t2), ("t8", 8, t8)]:
        seen_busbw = size / seconds * comm_bench.bus_factor("all_reduce", n)
        require(close(seen_busbw, busbw, 1e-6),
                f"{name}: one 16 MiB all-reduce on {n} ranks in that time is not 0.20 GB/s of "
                "bus bandwidth (the definitions are in labs/comm_bench.py's docstring)")
    require(close(algbw8 * t8, size, 1e-6),
            "algbw8 * t8 is not the 16 MiB the caller's all-reduce moves")


def pattern_bytes(n, dim, hidden, batch):
    """{"tp": bytes, "ddp": bytes} that rank 0 of n sends in the all-reduce of lesson 00's
    tp_pattern and ddp_pattern on make_problem's tensors: the lesson's own patterns, run on the
    fake process group, counted by the lab kit's CommCounter with lesson 00's ring factor."""
    import torch.distributed as dist

    import collective_workers
    from labkit.probes import CommCounter

    w1, w2, x = collective_workers.make_problem(dim=dim, hidden=hidden, batch=batch)
    sent = {}
    with fake_world(0, n):
        for name, pattern in (("tp", collective_workers.tp_pattern),
                              ("ddp", collective_workers.ddp_pattern)):
            counter = CommCounter({"world": dist.group.WORLD})
            with counter:
                pattern(0, n, w1, w2, x)
            sent[name] = counter.wire_bytes["c10d.allreduce_"]
    return sent


def check_0_3(tp_bytes, ddp_bytes, break_even_batch):
    """tp_bytes and ddp_bytes against lesson 00's patterns, and the batch where they meet."""
    for n, dim, hidden, batch in [(2, 8, 24, 12), (3, 8, 24, 12), (4, 16, 64, 8)]:
        sent = pattern_bytes(n, dim, hidden, batch)
        for name, answer, what in (("tp", tp_bytes, "the partial output"),
                                   ("ddp", ddp_bytes, "the gradient")):
            require(abs(answer(batch, dim, hidden, n) - sent[name]) <= 1,
                    f"{name}_bytes({batch}, {dim}, {hidden}, {n}) is not what rank 0 sends in "
                    f"{name}_pattern's all-reduce: how large is {what} it reduces, and what "
                    "does a ring send of it?")
        # TP's grows with the batch; DDP's is constant.
        per_sample = sent["tp"] / batch
        require(abs(break_even_batch(dim, hidden) - sent["ddp"] / per_sample) < 1e-9,
                f"break_even_batch({dim}, {hidden}): at that batch the two all-reduces do not "
                "send the same bytes")


# ------------------------------------------------------------------ lesson 01: DDP
def ddp_bucket_sizes(model, bucket_cap_mb, inputs, targets):
    """The bucket sizes DDP launches in the second backward, recorded by a comm hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.model import loss_fn

    launched = []

    def record(state, bucket):  # the stock all-reduce, plus a note of the bucket's size
        launched.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)

    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(None, record)
    for _ in range(2):  # DDP rebuilds its buckets after the first backward
        launched.clear()
        loss_fn(ddp(inputs), targets).backward()
    return launched


def check_1_1(predict_buckets):
    """predict_buckets(model, cap) equals DDP's buckets, world size 1, lab01's model."""
    import torch
    import torch.distributed as dist

    import lab01_ddp
    from labkit.data import SyntheticSequences

    cfg = lab01_ddp.parse_config([])
    data = SyntheticSequences(8, cfg.seq_len, cfg.vocab_size, seed=0)
    inputs, targets = map(torch.stack, zip(*(data[i] for i in range(8))))
    # World size 1 still runs the bucketed all-reduce.
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        for cap_mb in (0.05, 0.1, 0.25):
            model = lab01_ddp.build_model(cfg)
            predicted = predict_buckets(model, cap_mb)
            launched = ddp_bucket_sizes(model, cap_mb, inputs, targets)
            what = ("the number of buckets" if len(predicted) != len(launched)
                    else "the bucket sizes or their order")
            require(predicted == launched,
                    f"predict_buckets(model, {cap_mb}): {what} differs from what DDP launched")
    finally:
        dist.destroy_process_group()


def check_1_2(rank_indices):
    """rank_indices(...) equals what DistributedSampler yields after set_epoch."""
    from torch.utils.data import DistributedSampler

    for num_samples, world_size in [(10, 4), (11, 3), (3, 4), (100, 8)]:
        for epoch in (0, 1, 5):
            for rank in range(world_size):
                sampler = DistributedSampler(range(num_samples), num_replicas=world_size,
                                             rank=rank, shuffle=True, seed=0)
                sampler.set_epoch(epoch)
                require(rank_indices(num_samples, world_size, rank, epoch) == list(sampler),
                        f"rank_indices({num_samples}, {world_size}, {rank}, {epoch}) is not "
                        "what DistributedSampler yields on that rank in that epoch")


class NamedSamples:
    """A dataset whose sample i is the number i: what a loader yields names its samples."""

    def __init__(self, num_samples):
        self.num_samples = num_samples

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        import torch

        return torch.tensor([index]), torch.tensor([index])


def lab01_resumed_batch(num_samples, world_size, rank, micro_batch, grad_accum, start_step,
                        seed):
    """The dataset indices of the first micro-batch lab01's own micro_batches() yields on
    `rank` when the run resumes at optimizer step `start_step`."""
    import lab01_ddp

    cfg = lab01_ddp.parse_config(["--num-samples", str(num_samples), "--grad-accum",
                                  str(grad_accum), "--seed", str(seed)])
    cfg.batch_size = micro_batch * world_size * grad_accum
    original = lab01_ddp.build_dataset
    lab01_ddp.build_dataset = lambda cfg: NamedSamples(cfg.num_samples)
    try:
        inputs, _ = next(iter(lab01_ddp.micro_batches(cfg, rank, world_size, start_step)))
    finally:
        lab01_ddp.build_dataset = original
    return inputs.flatten().tolist()


def check_1_3(resumed_batch):
    """resumed_batch(...) equals the first micro-batch lab01 reads after a resume."""
    for num_samples, world_size, rank, micro_batch, grad_accum, start_step, seed in [
            (100, 3, 1, 4, 2, 7, 0), (512, 2, 1, 8, 1, 40, 0), (37, 4, 3, 2, 3, 5, 0),
            (64, 2, 0, 4, 1, 8, 0), (50, 4, 2, 3, 1, 3, 5)]:
        args = (num_samples, world_size, rank, micro_batch, grad_accum, start_step)
        require(resumed_batch(*args, seed=seed)
                == lab01_resumed_batch(*args, seed),
                f"resumed_batch{args}, seed={seed}: not the first micro-batch lab01 reads on rank "
                f"{rank} after resuming at step {start_step}: which epoch is that step in, how far "
                "into it, and how many samples does each rank get per epoch?")


# ------------------------------------------------------------------ lesson 02: FSDP
def check_2_1(total_gb, per_rank_gb, bf16_8b_per_rank_gb):
    """The 70B and 8B state sizes, against labs/memory_estimator.py."""
    import memory_estimator as est

    whole = est.estimate_per_rank(70e9, 1, "ddp").total_bytes / 1e9
    require(close(total_gb, whole), "total_gb: not params + grads + AdamW state of 70e9 fp32 "
                                    "parameters, in decimal GB")
    sharded = est.estimate_per_rank(70e9, 64, "zero3").total_bytes / 1e9
    require(close(per_rank_gb, sharded), "per_rank_gb: not that state split over 64 ranks")
    mixed = est.estimate_per_rank(8e9, 8, "zero3", param_bytes=2, grad_bytes=2,
                                  master_weights=True).total_bytes / 1e9
    require(close(bf16_8b_per_rank_gb, mixed),
            "bf16_8b_per_rank_gb: count every persistent copy (bf16 params and grads, fp32 "
            "AdamW states, the fp32 master weights)")


def check_2_2(fsdp_bytes_per_rank, metrics_path):
    """fsdp_bytes_per_rank(shapes, world_size) equals what lab02 measured (run 2.2)."""
    import memory_estimator as est

    metrics = json.loads(Path(metrics_path).read_text())
    shapes = list(metrics["param_shapes"].values())
    predicted = fsdp_bytes_per_rank(shapes, metrics["world_size"])
    measured = metrics["state_bytes_per_rank"]
    for kind in ("params", "grads", "optimizer"):
        mine = predicted.get(kind, [])
        require(len(mine) == len(measured[kind]), f"{kind}: want one entry per rank")
        wrong = [rank for rank, (a, b) in enumerate(zip(mine, measured[kind])) if a != b]
        require(not wrong, f"{kind}: ranks {wrong} differ from what the lab measured")
    # Not the learner's: the estimator, given the shapes, must predict the same padded bytes.
    padded = est.estimate_per_rank(None, 2, "zero3", shapes=shapes).params_bytes
    require(max(measured["params"]) == padded, "labs/memory_estimator.py disagrees with lab02")


def check_2_3(predict_chunks, num_files, step_dir):
    """predict_chunks(shape, 2) and num_files match the DCP checkpoint of run 2.2."""
    from torch.distributed.checkpoint import FileSystemReader

    step_dir = Path(step_dir)
    metadata = FileSystemReader(step_dir).read_metadata()
    params = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    require(len(params) == 21, f"{step_dir} is not the checkpoint of run 2.2: run it again")
    for name, meta in params.items():
        written = sorted((chunk.offsets[0], chunk.sizes[0]) for chunk in meta.chunks)
        require(predict_chunks(tuple(meta.size), 2) == written,
                f"predict_chunks({tuple(meta.size)}, 2) is not how {name} was written")
    require(num_files == len(list(step_dir.glob("*.distcp"))),
            "num_files is not the number of .distcp files in the checkpoint")


def check_2_4(hsdp_state_bytes, cross_replica_bytes, smallest_shards):
    """HSDP's state per rank and its traffic across replicas, against labs/memory_estimator.py
    and lesson 00's ring factor; the smallest shard group that holds a 70B model in 80 GB."""
    import comm_bench
    import memory_estimator as est

    for num_params, replicas, shards in [(70e9, 64, 8), (8e9, 4, 1), (8e9, 1, 8), (1e9, 2, 2),
                                         (70e9, 32, 16)]:
        label = f"({num_params:g}, {replicas}, {shards})"
        sharded = est.estimate_per_rank(num_params, shards, "zero3")
        require(close(hsdp_state_bytes(num_params, replicas, shards), sharded.total_bytes, 1e-6),
                f"hsdp_state_bytes{label}: not the params, grads and AdamW state one rank holds "
                "(fp32): over how many ranks is each copy of the state sharded?")
        across = comm_bench.bus_factor("all_reduce", replicas) * sharded.grads_bytes
        require(close(cross_replica_bytes(num_params, replicas, shards), across, 1e-6),
                f"cross_replica_bytes{label}: not what one rank sends over the replicate axis "
                "per step: which gradients cross it, and by which collective?")
    fits = next(shards for shards in (2**i for i in range(12))
                if est.estimate_per_rank(70e9, shards, "zero3").total_bytes <= 80e9)
    require(smallest_shards == fits,
            "smallest_shards is not the smallest power of two that holds the 70B state in 80 GB")


# ------------------------------------------------------------------ lesson 03: TP + FSDP
def check_3_1(mesh_shape, tp_group_of_13, dp_group_of_13):
    """The (dp, tp) mesh of 8 x 8 GPUs at TP 4, and rank 13's groups in it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    require(mesh_shape[0] * mesh_shape[1] == 64, "mesh_shape must cover every rank")
    require(len({rank // 8 for rank in tp_group_of_13}) == 1,
            "tp_group_of_13 leaves the node: TP must stay on one node's 8 GPUs")
    with fake_world(13, 64):
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        for axis, answer in (("tp", tp_group_of_13), ("dp", dp_group_of_13)):
            require(dist.get_process_group_ranks(mesh.get_group(axis)) == answer,
                    f"{axis}_group_of_13 is not rank 13's {axis} group on that mesh")


def check_3_2(tp_mlp):
    """tp_mlp(x, w1, w2, tp): per-rank partials, and the output the one collective gives."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, dtype=torch.float64, generator=generator)
    w1 = torch.randn(24, 8, dtype=torch.float64, generator=generator)
    w2 = torch.randn(8, 24, dtype=torch.float64, generator=generator)
    reference = F.gelu(x @ w1.T) @ w2.T
    for tp in (1, 2, 4):
        output, partials = tp_mlp(x, w1, w2, tp)
        require(len(partials) == tp and all(p.shape == reference.shape for p in partials),
                f"tp={tp}: want one full-size partial per rank")
        require(torch.allclose(output, reference, rtol=0, atol=1e-12),
                f"tp={tp}: the output is not gelu(x @ w1.T) @ w2.T")
        require(tp == 1 or not torch.allclose(partials[0], reference),
                f"tp={tp}: rank 0's partial already is the answer: no rank has it alone")


def lab03_wire_bytes(tp, batch, vocab_size, loss_parallel):
    """({collective: bytes}, seq_len): what rank 0 of a tp group sends in one forward and
    backward of lab03's model under the lab's TP plan (no FSDP, no sequence parallel), on the
    fake process group, counted by the lab kit's CommCounter."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel as parallel_loss

    import lab03_tp_fsdp
    from labkit.model import build_model, loss_fn
    from labkit.probes import CommCounter

    cfg = lab03_tp_fsdp.parse_config(["--tp", "1", "--num-heads", "8",
                                      "--vocab-size", str(vocab_size)])
    cfg.tp, cfg.loss_parallel = tp, loss_parallel  # the plan's inputs; the world is faked
    with fake_world(0, tp):
        mesh = init_device_mesh("cpu", (1, tp), mesh_dim_names=("dp", "tp"))
        model = build_model(cfg)
        lab03_tp_fsdp.apply_tp(model, mesh["tp"], cfg)
        tokens = torch.randint(0, vocab_size, (batch, cfg.seq_len + 1))
        counter = CommCounter({"tp": mesh["tp"].get_group()})
        with counter, parallel_loss() if loss_parallel else contextlib.nullcontext():
            loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return dict(counter.wire_bytes), cfg.seq_len


def check_3_3(logits_gather_bytes, loss_parallel_bytes, llama_gather_gb):
    """The logits' all-gather that --loss-parallel removes, what it sends instead, and the
    gather at Llama 3.1 8B's vocabulary, against lab03's plan counted on the fake group."""
    for tp, batch, vocab in [(2, 4, 64), (4, 2, 128), (8, 2, 64)]:
        plain, seq_len = lab03_wire_bytes(tp, batch, vocab, loss_parallel=False)
        parallel, _ = lab03_wire_bytes(tp, batch, vocab, loss_parallel=True)
        tokens, gather = batch * seq_len, plain["c10d_functional.all_gather_into_tensor"]
        require(abs(logits_gather_bytes(tokens, vocab, tp) - gather) <= 1,
                f"logits_gather_bytes({tokens}, {vocab}, {tp}) is not what rank 0 sends for the "
                "logits' all-gather: how large is the gathered tensor, and what share of it "
                "does one rank send?")
        instead = parallel["c10d_functional.all_reduce"] - plain["c10d_functional.all_reduce"]
        require("c10d_functional.all_gather_into_tensor" not in parallel and instead > 0,
                "lab03 under --loss-parallel no longer behaves as lesson 03 says")
        require(abs(loss_parallel_bytes(tokens, tp) - instead) <= 3,
                f"loss_parallel_bytes({tokens}, {tp}) is not what --loss-parallel adds: how "
                "many values per token does it reduce, and what does a ring send of them?")
    # The gather is linear in the logits: scale the last run's (tp 8) to 8192 x 128,256.
    llama = gather / (tokens * vocab) * 8192 * 128_256 / 1e9
    require(abs(llama_gather_gb - llama) < 1e-3,
            "llama_gather_gb is not the logits' all-gather of one 8192-token sequence with a "
            "vocabulary of 128,256 at tp 8, in GB (1e9 bytes)")


# ------------------------------------------------------------------ lesson 04: pipeline
def check_4_1(pp, microbatches, predicted_bubble, predicted_in_flight, metrics_path):
    """The 1F1B bubble and activations in flight of run 4.1, predicted before reading it."""
    metrics = json.loads(Path(metrics_path).read_text())
    require(metrics["config"]["microbatches"] == microbatches and metrics["world_size"] == pp,
            "pp and microbatches are not those of run 4.1")
    require(abs(predicted_bubble - (pp - 1) / microbatches) > 1e-12,
            "that is idle time over compute time (Megatron's (p-1)/m); the lab reports the idle "
            "share of the step (lesson 04 shows how the two relate)")
    bubble = metrics["bubble"]
    require(abs(predicted_bubble - bubble["formula"]) < 1e-12,
            "predicted_bubble is not the idle share of the step the formula gives")
    # The formula is the best case (equal stages, free communication): what the run measured,
    # and its replay with free communication, can only sit at or above it.
    require(min(bubble["measured"], bubble["replayed"]) >= predicted_bubble - 0.03,
            "the run measured a smaller bubble than the best case: rerun 4.1 on an idle machine")
    require(metrics["microbatches_in_flight_per_rank"] == predicted_in_flight,
            "predicted_in_flight is not what each rank held at most under 1F1B")


def check_4_2(looped, v_shape):
    """Stage ids per rank for Interleaved1F1B and ZBVZeroBubble, 4 ranks x 2 stages."""
    import argparse

    import lab04_pipeline

    for name, answer, label in (("Interleaved1F1B", looped, "looped"),
                                ("ZBVZeroBubble", v_shape, "v_shape")):
        cfg = argparse.Namespace(schedule=name, stages_per_rank=2)
        for rank in range(4):
            require(lab04_pipeline.stage_ids_for_rank(rank, 4, cfg) == answer[rank],
                    f"{label}[{rank}] is not the stages {name} runs on rank {rank}")


def schedule_in_flight(schedule, pp, microbatches):
    """Per rank, the most microbatches whose activations it holds under torch's own schedule:
    the action order the schedule class builds (pipeline_order; on the fake process group, as
    rank 0 of pp), read as lab04's timeline reads a run (labkit.timeline)."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    from labkit.pipeline import schedule_class
    from labkit.timeline import microbatches_in_flight

    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    with fake_world(0, pp):
        stage = PipelineStage(torch.nn.Linear(2, 2), 0, pp, torch.device("cpu"))
        order = schedule_class(schedule)(stage, microbatches).pipeline_order
    # One slot per action: (kind, stage, microbatch, start, end), as the timeline records them.
    return [microbatches_in_flight([(kinds.get(a.computation_type.name, "-"), a.stage_index,
                                     a.microbatch_index, slot, slot)
                                    for slot, a in enumerate(order[rank]) if a is not None])
            for rank in range(pp)]


def check_4_3(in_flight, gpipe_over_1f1b):
    """in_flight(schedule, pp, microbatches) against torch's GPipe and 1F1B, and the ratio."""
    for schedule, pp, microbatches in [("GPipe", 2, 8), ("GPipe", 4, 8), ("GPipe", 4, 2),
                                       ("1F1B", 2, 8), ("1F1B", 4, 8), ("1F1B", 4, 4),
                                       ("1F1B", 3, 5), ("1F1B", 8, 16)]:
        require(in_flight(schedule, pp, microbatches)
                == schedule_in_flight(schedule, pp, microbatches),
                f"in_flight({schedule!r}, {pp}, {microbatches}) is not what {schedule}'s ranks "
                "hold: when does each rank run its first backward?")
    ratio = schedule_in_flight("GPipe", 4, 32)[0] / schedule_in_flight("1F1B", 4, 32)[0]
    require(abs(gpipe_over_1f1b - ratio) < 1e-9,
            "gpipe_over_1f1b is not rank 0's GPipe count over its 1F1B count at pp 4, m 32")


# ------------------------------------------------------------------ lesson 05: 3-D
def check_5_1(predicted_counts):
    """predicted_counts(...) equals the collectives every rank records in one real step, on
    pp 4 x dp 2 x tp 1 and pp 4 x dp 1 x tp 2 (8 processes, about 20 s each). Call it under
    `if __name__ == "__main__":`: spawn imports your file again in every process."""
    import threed_workers
    from spawn import run_workers

    for dp, tp in ((2, 1), (1, 2)):
        layout = ["--pp", "4", "--dp", str(dp), "--tp", str(tp)]
        ranks = run_workers(threed_workers.one_recorded_step, 8, layout, timeout_s=120,
                            startup_s=240)
        for r in ranks:
            (stage,) = r["stages"]
            want = predicted_counts(m=4, blocks=1, first=stage == 0, last=stage == 3,
                                    dp=dp, tp=tp)
            wrong = sorted(str(key) for key in set(want) | set(r["counts"])
                           if want.get(key) != r["counts"].get(key))
            require(not wrong, f"{' '.join(layout)}, rank at {r['coords']}: the counts of "
                               f"{', '.join(wrong)} differ from the recorded step")


def plan_verdict(nproc, *extra):
    """(total GB, verdict) of lab05's --plan for the 70B model on H100s, pp 4 x tp 8."""
    out = subprocess.run(
        [sys.executable, str(REPO / "labs" / "lab05_3d.py"), "--plan", "--model", "70b",
         "--gpu", "H100-80GB", "--nproc", str(nproc), "--pp", "4", "--dp", str(nproc // 32),
         "--tp", "8", "--microbatches", "8", *extra],
        capture_output=True, text=True, check=True).stdout
    total, verdict = re.search(r"total\s+([\d.]+) GB of 80.0 GB: (fits|does NOT fit)",
                               out).groups()
    return float(total), verdict


def check_5_2(smallest_nproc, fits_at, total_gb_at, without_recompute_at_512):
    """The smallest cluster the 70B plan fits on, and the verdict without recompute."""
    recompute = "--activation-checkpointing"
    require(smallest_nproc % 32 == 0, "smallest_nproc must be a multiple of 32 (pp 4 x tp 8)")
    total, verdict = plan_verdict(smallest_nproc, recompute)
    require(verdict == "fits", "the plan does not fit at smallest_nproc")
    require(smallest_nproc == 32 or plan_verdict(smallest_nproc - 32, recompute)[1] != "fits",
            "smallest_nproc is not the smallest: 32 fewer GPUs fit too")
    require(fits_at == verdict and abs(total_gb_at - total) < 0.01,
            "fits_at or total_gb_at is not what the plan prints at smallest_nproc")
    require(without_recompute_at_512 == plan_verdict(512)[1],
            "without_recompute_at_512 is not the plan's verdict at 512 GPUs")


# ------------------------------------------------------------------ lesson 06: performance
def check_6_1(flop_per_token, published_mfu):
    """flop_per_token(cfg, seq_len) on two models, and the published 8B run's MFU."""
    import argparse

    import lab01_ddp
    from labkit.model import MODEL_PRESETS, flops_per_token

    debug = lab01_ddp.parse_config([])  # the labs' default model: 2 blocks, width 64
    llama_8b = argparse.Namespace(**MODEL_PRESETS["8b"])
    for label, cfg, seq_len in (("the labs' default model", debug, 32),
                                ("Llama 3.1 8B", llama_8b, 8192)):
        require(flop_per_token(cfg, seq_len) == flops_per_token(cfg, seq_len),
                f"flop_per_token on {label} at {seq_len} tokens: which weights are matmuls, "
                "and is attention's term there?")
    mfu = 5762 * flops_per_token(llama_8b, 8192) / 989e12
    require(abs(published_mfu - mfu) < 5e-4, "published_mfu: achieved FLOP/s over the peak")


def check_6_2(fsdp_comm_s, break_even_mfu):
    """FSDP's traffic per step, and the MFU at which it stops hiding, against perf_model."""
    import perf_model

    params, flop, tokens = 8_030_261_248, 57_912_852_480, 8192
    reference = perf_model.datasheet_tokens_per_s("fsdp", params, flop, tokens, 64, 989e12, 50e9)
    require(close(fsdp_comm_s(params, 64, 50e9), reference["comm_s"], 1e-9),
            "fsdp_comm_s: count every ring (two bf16 all-gathers, one fp32 reduce-scatter)")
    require(close(fsdp_comm_s(1e9, 2, 1e11), 0.04, 1e-9),
            "fsdp_comm_s(1e9, 2, 1e11) is not the three rings' seconds at 2 ranks, 100 GB/s")
    require(abs(break_even_mfu - reference["compute_s"] / reference["comm_s"]) < 1e-3,
            "break_even_mfu: the MFU at which compute takes as long as the traffic")


# ------------------------------------------------------------------ lesson 07: context parallel
def causal_blocks(world_size, layout):
    """Blocks each rank computes in one causal forward, counted with the lesson's own rules."""
    import context_workers as cw

    chunks = cw.num_chunks(world_size, layout)
    return [sum(1 for q_id in cw.chunk_ids(rank, world_size, layout) for k_id in range(chunks)
                if cw.visible(q_id, k_id, causal=True))
            for rank in range(world_size)]


def check_7_1(blocks_per_rank):
    """blocks_per_rank(world_size, layout), for the contiguous and the zig-zag split."""
    for world_size in (2, 3, 4, 8):
        for layout in ("contiguous", "zigzag"):
            require(blocks_per_rank(world_size, layout) == causal_blocks(world_size, layout),
                    f"blocks_per_rank({world_size}, {layout!r}) is not what the ring computes")


def ring_bytes_sent_by_rank0(seq_len, heads, head_dim, world_size):
    """Bytes rank 0 sends in the lesson's ring_attention forward and backward (zig-zag, fp32),
    counted by running the real code with rotations that count instead of sending."""
    import context_workers as cw

    sent = [0]

    def counting_rotate(tensor, group=None):  # moves nothing: only the byte count matters
        sent[0] += tensor.numel() * tensor.element_size()
        return tensor.clone()

    original = cw.rank_and_size, cw.rotate, cw.post_rotation
    cw.rank_and_size = lambda group=None: (0, world_size)  # act as rank 0 of the ring
    cw.rotate = counting_rotate
    cw.post_rotation = lambda tensor, group=None: (counting_rotate(tensor), [])
    try:
        q, k, v, dout = cw.make_qkv(seq_len, heads, head_dim)
        local = [cw.shard_sequence(t, 0, world_size, "zigzag").requires_grad_()
                 for t in (q, k, v)]
        cw.ring_attention(*local, layout="zigzag").backward(
            cw.shard_sequence(dout, 0, world_size, "zigzag"))
    finally:
        cw.rank_and_size, cw.rotate, cw.post_rotation = original
    return sent[0]


def check_7_2(ring_bytes_per_rank):
    """ring_bytes_per_rank(seq_len, heads, head_dim, world_size), forward and backward."""
    for world_size in (2, 4):
        require(ring_bytes_per_rank(64, 2, 8, world_size)
                == ring_bytes_sent_by_rank0(64, 2, 8, world_size),
                f"ring_bytes_per_rank(64, 2, 8, {world_size}) is not what the ring sends: "
                "count every rotation, forward and backward, and what each one carries")


# ------------------------------------------------------------------ lesson 08: experts
def check_8_1(dispatch_bytes, deepseek_dispatch_gb):
    """dispatch_bytes(...) against a simulated uniform router, and the DeepSeek-sized figure."""
    import torch

    generator = torch.Generator().manual_seed(0)
    for world_size, top_k, experts in ((2, 2, 8), (4, 2, 8), (8, 8, 64)):
        tokens, dim = 4000, 16
        picks = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=-1).indices
        leaving = (picks // (experts // world_size) != 0).sum().item()  # as seen from rank 0
        simulated = leaving * dim * 4
        predicted = dispatch_bytes(tokens, top_k, dim, world_size, 4)
        require(abs(predicted - simulated) / simulated < 0.03,
                f"dispatch_bytes at {world_size} ranks, k = {top_k}: more than 3% from a "
                "simulated uniform router (which choices stay on their own rank?)")
    # 8 ranks, 4096 tokens each, k = 8, dim 7168, bf16: 7 of every 8 choices leave the rank.
    deepseek = 4096 * 8 * (8 - 1) / 8 * 7168 * 2 / 1e9
    require(abs(deepseek_dispatch_gb - deepseek) < 0.001,
            "deepseek_dispatch_gb is not one rank's dispatch for those sizes, in GB (1e9 bytes)")


def check_8_2(min_capacity_factor):
    """min_capacity_factor(counts, num_tokens, top_k): no drop at it, a drop just below it."""
    import torch

    import moe_workers as mw

    torch.manual_seed(0)
    x, _ = mw.make_tokens(512, skew=1.0)
    params = mw.make_params()
    with torch.no_grad():
        _, stats = mw.moe_reference(x, params, 100.0)  # nothing dropped: the true counts
        factor = min_capacity_factor(stats["counts"].tolist(), 512, mw.TOP_K)
        require(mw.moe_reference(x, params, factor)[1]["dropped"] == 0,
                "the layer still drops tokens at that capacity factor")
        require(mw.moe_reference(x, params, factor * 0.97)[1]["dropped"] > 0,
                "a capacity factor 3% smaller drops nothing either: it is not the smallest")


def moe_dispatch_splits(rank, world_size, tokens_per_rank, skew):
    """One rank of lesson 08's expert-parallel layer (spawn.run_workers): its routing, and the
    split sizes moe_expert_parallel passes to its dispatch, recorded on the way."""
    import torch
    import torch.distributed._functional_collectives as funcol

    import moe_workers

    calls, original = [], funcol.all_to_all_single

    def recording(tensor, output_split_sizes, input_split_sizes, group):
        calls.append({"input": list(input_split_sizes), "output": list(output_split_sizes)})
        return original(tensor, output_split_sizes, input_split_sizes, group)

    x_all, _ = moe_workers.make_tokens(tokens_per_rank * world_size, skew=skew)
    x = x_all[rank * tokens_per_rank:(rank + 1) * tokens_per_rank]
    params = moe_workers.local_experts(moe_workers.make_params(), rank, world_size)
    funcol.all_to_all_single = recording
    try:
        with torch.no_grad():
            experts, _, _ = moe_workers.route(x, params["router"])
            moe_workers.moe_expert_parallel(x, params, capacity_factor=100.0)
    finally:
        funcol.all_to_all_single = original
    return {"expert_ids": experts.flatten().tolist(), "dispatch": calls[0]}


def check_8_3(dispatch_splits):
    """dispatch_splits(expert_ids, rank, world_size, num_experts) against the splits every rank
    of lesson 08's layer passed to its dispatch, on 2 and 4 gloo processes (spawn: call it under
    `if __name__ == "__main__":`)."""
    import moe_workers
    from spawn import run_workers

    for world_size, skew in ((2, 0.0), (4, 1.0)):
        ranks = run_workers(moe_dispatch_splits, world_size, 24, skew, timeout_s=60)
        expert_ids = [r["expert_ids"] for r in ranks]
        for rank, r in enumerate(ranks):
            sizes = tuple(dispatch_splits(expert_ids, rank, world_size, moe_workers.NUM_EXPERTS))
            require(len(sizes) == 2, "want (input_split_sizes, output_split_sizes)")
            for mine, key in zip(sizes, ("input", "output")):
                require(list(mine) == r["dispatch"][key],
                        f"dispatch_splits(expert_ids, {rank}, {world_size}, "
                        f"{moe_workers.NUM_EXPERTS}): the {key}_split_sizes differ from what "
                        f"rank {rank} passed to its dispatch: who sends those rows, to whom?")
