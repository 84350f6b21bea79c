"""--timeline: when every forward and backward of a pipeline ran on every rank, the bubble it
measures, replays and predicts, and the activation bytes each rank keeps for backward. A probe:
it wraps the stages' three action methods, the schedule's step and the loss, so the lab's
pipeline code holds none of it. Disabled (--timeline off; the default on CUDA, where timing
an action means synchronising the GPU around it), it records nothing and changes nothing."""

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def add_timeline_args(parser):
    parser.add_argument("--timeline", choices=["auto", "on", "off"], default="auto",
                        help="record each stage action's start and end, for the measured "
                             "bubble; auto: on cpu, off on cuda (it synchronises the GPU "
                             "around every action)")


class SavedActivations:
    """Bytes autograd keeps alive for backward, via saved_tensors_hooks: each storage counted
    once (several ops often save the same tensor), parameters (and views of them) excluded."""

    def __init__(self):
        self.refs, self.live, self.peak = {}, 0, 0

    def pack(self, tensor):
        base = tensor if tensor._base is None else tensor._base
        if isinstance(base, nn.Parameter):
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        count, nbytes = self.refs.get(key, (0, storage.nbytes()))
        if count == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] = (count + 1, nbytes)
        # detach(): a saved output that kept its grad_fn would point back at the graph that
        # saves it, a cycle Python's gc cannot see, and retained graphs (zero-bubble I/W)
        # would leak. Autograd restores the graph edges itself when it unpacks.
        return _Saved(tensor.detach(), key, self)

    def unpack(self, saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key):
        count, nbytes = self.refs.pop(key)
        if count > 1:
            self.refs[key] = (count - 1, nbytes)
        else:
            self.live -= nbytes

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Saved:
    """A saved tensor; autograd drops it when the microbatch's graph is freed (after B or W)."""

    def __init__(self, tensor, key, owner):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        self.owner.release(self.key)


class Timeline:
    """Start and end of every compute action on this rank, in seconds since the step began.
    Every schedule runs its actions through three PipelineStage methods, so wrapping them on
    the stage instances times the compute alone: the waits for send/recv fall outside.
    Disabled (--timeline off; the default on CUDA, where timing an action means synchronising
    the GPU around it), it records nothing and changes nothing."""

    def __init__(self, cfg, device):
        self.device, self.enabled = device, timeline_enabled(cfg, device)
        self.steps, self.events, self.t0 = [], [], 0.0
        self.memory = SavedActivations()

    def attach(self, stages, schedule):
        """Time every action of these stages, and start a step's clock with each
        schedule.step()."""
        if not self.enabled:
            return
        for stage in stages:
            self.instrument(stage)  # outside autocast: the action's whole time
        step = schedule.step

        def timed_step(*args, **kwargs):
            self.start_step()
            return step(*args, **kwargs)
        schedule.step = timed_step

    def start_step(self):
        if not self.enabled:
            return
        dist.barrier()  # one tiny all-reduce: every rank's clock origin is the same moment
        self.events, self.t0 = [], time.perf_counter()
        self.steps.append(self.events)

    def _timed(self, kind_of, stage_id, fn, forward=False):
        def timed(*args, **kwargs):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # time the kernels, not their launch
            start, cpu_start = time.perf_counter(), time.thread_time()
            with self.memory.hooks() if forward else contextlib.nullcontext():
                out = fn(*args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            kind = kind_of(args, kwargs)
            self.events.append([kind, stage_id, args[0], start - self.t0,
                                time.perf_counter() - self.t0, time.thread_time() - cpu_start])
            return out
        return timed

    def instrument(self, stage):
        if not self.enabled:
            return

        def backward_kind(args, kwargs):  # backward_one_chunk(mb, loss, full_backward, ...)
            full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
            return "B" if full else "I"
        sid = stage.stage_index
        stage.forward_one_chunk = self._timed(lambda a, k: "F", sid, stage.forward_one_chunk,
                                              forward=True)
        stage.backward_one_chunk = self._timed(backward_kind, sid, stage.backward_one_chunk)
        stage.backward_weight_one_chunk = self._timed(lambda a, k: "W", sid,
                                                      stage.backward_weight_one_chunk)

    def counted(self, loss_fn):
        if not self.enabled:
            return loss_fn

        def counted_loss(logits, targets):  # the loss's saved tensors count too
            with self.memory.hooks():
                return loss_fn(logits, targets)
        return counted_loss


def timeline_enabled(cfg, device):
    return cfg.timeline == "on" or (cfg.timeline == "auto" and device.type == "cpu")


def bubble_formula(cfg, pp_size):
    """Idle share of a step for a perfectly balanced pipeline with free communication."""
    m, v = cfg.microbatches, cfg.stages_per_rank
    if cfg.schedule in ("GPipe", "1F1B"):
        return (pp_size - 1) / (m + pp_size - 1)  # GPipe paper; 1F1B only saves memory
    if cfg.schedule in ("Interleaved1F1B", "LoopedBFS"):
        return (pp_size - 1) / (v * m + pp_size - 1)  # each of the pp-1 fill slots is 1/v long
    return None  # zero-bubble family: no closed form; the papers claim ~0 when F = I = W


def replay_span(rank_events, duration):
    """Replay each rank's actions in the order they ran, each lasting duration(event) and
    starting once its rank is free and its input exists (F after the previous stage's F; B or
    I after the next stage's B or I; W after its own I), with free, instant communication.
    Returns {action: (start, end)}."""
    last_stage = max(e[1] for events in rank_events for e in events)
    placed, free, pos = {}, [0.0] * len(rank_events), [0] * len(rank_events)

    def needs(kind, stage, mb):
        if kind == "F":
            return [("F", stage - 1, mb)] if stage > 0 else []
        if kind in ("B", "I"):
            if stage == last_stage:
                return [("F", stage, mb)]
            return [(k, stage + 1, mb) for k in ("B", "I") if (k, stage + 1, mb) in placed]
        return [("I", stage, mb)]  # W

    while any(p < len(events) for p, events in zip(pos, rank_events)):
        progressed = False
        for r, events in enumerate(rank_events):
            while pos[r] < len(events):
                kind, stage, mb = events[pos[r]][:3]
                deps = needs(kind, stage, mb)
                waiting = kind in ("B", "I") and stage < last_stage and not deps
                if waiting or any(d not in placed for d in deps):
                    break
                start = max([free[r]] + [placed[d][1] for d in deps])
                free[r] = start + duration(events[pos[r]])
                placed[(kind, stage, mb)] = (start, free[r])
                pos[r], progressed = pos[r] + 1, True
        assert progressed, "timeline replay deadlocked: an action's input never ran"
    return placed


def bubble_of(rank_events, duration=None):
    """1 - busy / span per rank, span from the first action on any rank to the last; the
    pipeline's bubble is the mean over ranks. Measured (wall clock) when duration is None,
    else replayed with those durations."""
    if duration is None:
        spans = [[(e[3], e[4]) for e in events] for events in rank_events]
    else:
        placed = replay_span(rank_events, duration)
        spans = [[placed[tuple(e[:3])] for e in events] for events in rank_events]
    start = min(s for rank in spans for s, _ in rank)
    span = max(e for rank in spans for _, e in rank) - start
    per_rank = [1 - sum(e - s for s, e in rank) / span for rank in spans]
    return sum(per_rank) / len(per_rank), per_rank


def analyse_timeline(steps_per_rank, use_cpu_time):
    """The measured bubble of every step, the median step's timeline (the first step also
    infers shapes and warms up, so it is left out), and the replayed bubble: the median
    step's action order, each action costing the minimum over all steps of its (kind, stage)
    (CPU time on CPU; wall time on GPUs, one device per rank). The minimum, not the median:
    interference (gloo's threads, the allocator, a VM's stolen time) only ever adds time.
    Between identical idle runs the replayed bubble still landed 0.00 to 0.12 above the
    formula (LoopedBFS: 0.12-0.20 against 0.11): what remains is that run's real imbalance
    between ranks and stages, so the formula itself is checked by the equal-stage replay
    below."""
    steps = []
    for k in range(len(steps_per_rank[0])):
        measured, per_rank = bubble_of([rank_steps[k] for rank_steps in steps_per_rank])
        steps.append((measured, k, per_rank))
    steady = sorted(steps[1:] or steps)
    measured, k, per_rank = steady[len(steady) // 2]
    costs = {}
    for _, j, _ in steady:
        for rank_steps in steps_per_rank:
            for e in rank_steps[j]:
                costs.setdefault((e[0], e[1]), []).append(e[5] if use_cpu_time else e[4] - e[3])
    cost = {key: min(v) for key, v in costs.items()}
    events = [rank_steps[k] for rank_steps in steps_per_rank]
    replayed, _ = bubble_of(events, lambda e: cost[(e[0], e[1])])
    # The same action order with the formula's assumptions: every stage equally fast (F = 1,
    # a full backward B = 2, its halves I = W = 1). Whatever remains is the schedule's shape.
    unit_cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    replayed_equal_stages, _ = bubble_of(events, lambda e: unit_cost[e[0]])
    return {"measured": measured, "measured_per_rank": per_rank, "replayed": replayed,
            "replayed_equal_stages": replayed_equal_stages,
            "measured_all_steps": [s[0] for s in steps],
            "replay_cost": "min cpu_time" if use_cpu_time else "min wall_time",
            "timeline_step": k + 1}, events


def microbatches_in_flight(events):
    """Most microbatches whose forward finished and whose backward (B, or W when the schedule
    splits it) has not: each holds its activations on this rank."""
    deltas = sorted((e[4], {"F": 1, "B": -1, "W": -1}.get(e[0], 0)) for e in events)
    held = peak = 0
    for _, delta in deltas:
        held += delta
        peak = max(peak, held)
    return peak


def timeline_metrics(cfg, timeline, stages, world_size):
    """Gather every rank's timeline and activation peak: the measured bubble and memory."""
    gathered = [None] * world_size
    mine = {"steps": timeline.steps, "saved_peak": timeline.memory.peak,
            "stages": [s.stage_index for s in stages]}
    dist.all_gather_object(gathered, mine)  # one object per rank, once, after training
    result = {"stages_per_rank_ids": [g["stages"] for g in gathered],
              "saved_activation_peak_bytes_per_rank": [g["saved_peak"] for g in gathered]}
    if not timeline.enabled:
        return {**result, "bubble": None, "timeline": None}
    pp_size = world_size // cfg.dp
    pipeline = gathered[:pp_size]  # dp replica 0's pipeline: ranks 0..pp-1
    use_cpu_time = stages[0].device.type == "cpu" and torch.get_num_threads() == 1
    bubble, events = analyse_timeline([g["steps"] for g in pipeline], use_cpu_time)
    bubble["formula"] = bubble_formula(cfg, pp_size)
    return {
        **result, "bubble": bubble,
        "timeline": {"columns": ["kind", "stage", "microbatch", "start_s", "end_s", "cpu_s"],
                     "ranks": events},
        "microbatches_in_flight_per_rank": [microbatches_in_flight(e) for e in events],
    }


def accumulation_order(timeline, stages, num_microbatches):
    """The microbatch order this rank's first stage accumulated gradients in (in B, or in W
    when the schedule splits backward), read off the last step's timeline (LoopedBFS runs
    backward last microbatch first); microbatch order when there is no timeline."""
    order = [e[2] for e in (timeline.steps[-1] if timeline.steps else [])
             if e[0] in ("B", "W") and e[1] == stages[0].stage_index]
    return order or list(range(num_microbatches))
