"""The wrong solutions: each is a reference solution (exercises/solutions/<exercise>.py) with one
mistake people really make, written down as the edit that plants it. Write them out and grade
one to see what the grader says about its mistake:

    python exercises/wrong_solutions.py                       # the list: name and mistake
    python exercises/wrong_solutions.py ddp_missing_wait      # one, printed
    python exercises/wrong_solutions.py --write /tmp/wrong    # /tmp/wrong/<name>.py, each
    python exercises/grade.py ddp /tmp/wrong/ddp_missing_wait.py

It lives here, beside solutions/ and grade.py, and not in tests/, because it is course
material: exercises/README.md sends the learner to it, and each entry's edits, read next to its
reference solution, are the mistake. tests/test_exercises.py grades every one and checks that
the grader's output names its mistake.

An entry: the exercise whose reference it edits, a one-line description (the built file's
docstring), the edits as (old, new) pairs, each `old` occurring exactly once in the reference
(so a change to the reference that breaks an edit fails loudly, naming the mistake), and
what the grader's output must say about the mistake.
"""

import argparse
import ast
import sys
from pathlib import Path
from typing import NamedTuple

SOLUTIONS = Path(__file__).resolve().parent / "solutions"


class Mistake(NamedTuple):
    exercise: str  # the reference it edits: exercises/solutions/<exercise>.py
    description: str  # one line: the built file's docstring
    edits: tuple  # (old, new) pairs; each old occurs exactly once in the reference
    grader_says: str  # what the grader's output must contain about this mistake


MISTAKES = {
    # --- ddp --------------------------------------------------------------------------------------
    "ddp_averaged_twice": Mistake(
        exercise="ddp",
        description="Gradients averaged twice: divided by world_size before the all-reduce and "
                    "again after it.",
        edits=(
            ('''\
    def _grad_ready(self, param):
''', '''\
    def _grad_ready(self, param):
        param.grad.div_(self.world_size)  # pre-divide, so the SUM is already the mean ...
'''),
            ('''\
            flat.div_(self.world_size)
''', '''\
            flat.div_(self.world_size)  # THE MISTAKE: ... and divide again after the sum
'''),
        ),
        grader_says="averaged twice? your grads are 0.50x the reference"),
    "ddp_hooks_frozen_params": Mistake(
        exercise="ddp",
        description="Registers a gradient hook on every parameter, frozen ones too (torch "
                    "refuses).",
        edits=(
            ("trainable = [p for p in module.parameters() if p.requires_grad]",
             "trainable = list(module.parameters())  # THE MISTAKE: frozen parameters included"),
        ),
        grader_says="a frozen parameter? skip parameters with requires_grad=False"),
    "ddp_missing_wait": Mistake(
        exercise="ddp",
        description="Launches async all-reduces but never waits: .grad keeps this rank's own "
                    "gradients.",
        edits=(
            ('''\
        for index, flat, work in self.in_flight:
            work.wait()
            # Sum, then divide once: works on every backend and version (gloo gained
            # ReduceOp.AVG only in 2025, pytorch/pytorch#149781).
            flat.div_(self.world_size)
            offset = 0
            for param in self.buckets[index]:
                param.grad.copy_(flat[offset:offset + param.numel()].view_as(param))
                offset += param.numel()
''', '''\
        # THE MISTAKE: "the all-reduce is already running", so nothing to do here; but the
        # results land in the flat buffers, never waited for and never copied into .grad.
'''),
        ),
        grader_says="did it wait for the all-reduce and copy the result back?"),
    "ddp_no_broadcast": Mistake(
        exercise="ddp",
        description="No broadcast of rank 0's parameters and buffers at construction: replicas "
                    "start different.",
        edits=(
            ('''\
        # Same starting point everywhere: one broadcast per tensor, from rank 0. Frozen
        # parameters too (they must match), and buffers (e.g. BatchNorm's running stats).
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
''', '''\
        # THE MISTAKE: no broadcast from rank 0, so each replica keeps its own initial weights.
'''),
        ),
        grader_says="broadcast rank 0's parameters and buffers in the constructor"),
    "ddp_no_overlap": Mistake(
        exercise="ddp",
        description="All-reduces every bucket in finish_gradient_sync, after backward: right "
                    "grads, no overlap.",
        edits=(
            ('''\
        if self.num_ready[index] == len(self.buckets[index]):
            # The bucket's last gradient: copy them into one flat buffer and start one
            # all-reduce for all of them. async_op=True returns at once; backward goes on.
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[index]])
            self.in_flight.append((index, flat, dist.all_reduce(flat, async_op=True)))
''', '''\
        # THE MISTAKE: the hook only counts; the communication waits until backward is over.
'''),
            ('''\
        assert len(self.in_flight) == len(self.buckets), (
            f"{len(self.buckets) - len(self.in_flight)} bucket(s) never launched: "
            "a trainable parameter got no gradient in this backward")
        for index, flat, work in self.in_flight:
            work.wait()
''', '''\
        for index, bucket in enumerate(self.buckets):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat)
'''),
        ),
        grader_says="none of 5 all-reduces was launched during backward"),
    "ddp_tied_weight_twice": Mistake(
        exercise="ddp",
        description="Averages grads module by module: the tied weight is in two modules, divided "
                    "twice.",
        edits=(
            ('''\
            # Sum, then divide once: works on every backend and version (gloo gained
            # ReduceOp.AVG only in 2025, pytorch/pytorch#149781).
            flat.div_(self.world_size)
''', ""),
            ('''\
        self.in_flight.clear()  # ready for the next backward
''', '''\
        self.in_flight.clear()  # ready for the next backward
        # Sum -> mean, layer by layer. THE MISTAKE: the embedding and the output layer hold
        # the same Parameter, so its gradient is divided by world_size twice.
        for layer in self.module.modules():
            for param in layer.parameters(recurse=False):
                if param.requires_grad:
                    param.grad.div_(self.world_size)
'''),
        ),
        grader_says="only embed.weight is wrong (0.50x the reference): the tied weight"),
    # --- zero1 ------------------------------------------------------------------------------------
    "zero1_no_broadcast": Mistake(
        exercise="zero1",
        description="Steps its own shard but never sends the updated parameters to the other "
                    "ranks.",
        edits=(
            ('''\
        # Each parameter from the rank that just updated it: one broadcast per parameter.
        # (An all-gather of flat shards does the same in one collective; this is the plain form.)
        with torch.no_grad():
            for param, owner in zip(self.params, self.owners):
                dist.broadcast(param, src=owner)
''', '''\
        # THE MISTAKE: each rank updates its shard, and the other ranks never hear of it.
'''),
        ),
        grader_says="broadcast each updated shard from its owner after step()"),
    "zero1_no_sharding": Mistake(
        exercise="zero1",
        description="No sharding: every rank's optimizer holds all the parameters and updates "
                    "the whole model.",
        edits=(
            ('''\
        # The optimizer state (AdamW: exp_avg and exp_avg_sq, 2x the parameters' bytes) now
        # exists for this rank's shard only: the whole point of ZeRO-1.
        self.optimizer = optimizer_class(shard, **defaults)
''', '''\
        # THE MISTAKE: the inner optimizer gets every group, whole. The parameters come out
        # right (every rank has the same gradients), but each rank holds the full state.
        self.optimizer = optimizer_class(groups, **defaults)
'''),
        ),
        grader_says="every rank updates the whole model (no sharding)"),
    "zero1_uneven_split": Mistake(
        exercise="zero1",
        description="Uneven split mishandled: len(params) // world_size params per rank; the "
                    "rest get no owner.",
        edits=(
            ('''\
        self.owners = assign_owners(self.params, dist.get_world_size())
        rank = dist.get_rank()
        mine = {id(p) for p, owner in zip(self.params, self.owners) if owner == rank}
''', '''\
        world_size, rank = dist.get_world_size(), dist.get_rank()
        # THE MISTAKE: 8 parameters over 3 ranks gives 2 each; parameters 6 and 7 fall off the
        # end. (The clamp below keeps the broadcast legal, so nothing crashes.)
        per_rank = len(self.params) // world_size
        self.owners = [min(i // per_rank, world_size - 1) for i in range(len(self.params))]
        mine = {id(p) for p in self.params[rank * per_rank:(rank + 1) * per_rank]}
'''),
        ),
        grader_says="does your split drop the remainder (8 params over 3 ranks)?"),
    "zero1_weight_decay_everywhere": Mistake(
        exercise="zero1",
        description="Flattens the param groups, so weight decay hits the parameters whose group "
                    "turned it off.",
        edits=(
            ('''\
        # Keep each group's own options (weight_decay=0.0 for biases, ...), restricted to
        # this rank's parameters; a group with none of them is left out.
        shard = [{**group, "params": [p for p in group["params"] if id(p) in mine]}
                 for group in groups]
        shard = [group for group in shard if group["params"]]
''', '''\
        # THE MISTAKE: one flat list of this rank's parameters: the group options are lost,
        # and defaults' weight_decay applies to the biases and norms too.
        shard = [p for p in self.params if id(p) in mine]
'''),
        ),
        grader_says="only the weight_decay=0.0 group differs"),
    "zero1_zero_grad_own_shard": Mistake(
        exercise="zero1",
        description="zero_grad clears only this rank's shard (the inner optimizer's), not every "
                    "parameter.",
        edits=(
            ('''\
        # Every parameter, not only this rank's shard: all of them got a gradient.
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()
''', '''\
        # THE MISTAKE: the inner optimizer knows only this rank's parameters.
        self.optimizer.zero_grad(set_to_none=set_to_none)
'''),
        ),
        grader_says="zero every parameter's grad, not only your shard's"),
    # --- fsdp -------------------------------------------------------------------------------------
    "fsdp_backward_on_freed_params": Mistake(
        exercise="fsdp",
        description="Frees the params after forward but never all-gathers them again before "
                    "backward.",
        edits=(
            ('''\
        self.free_params()  # autograd's saved references to the params now point at 0 bytes
        if out.requires_grad:
            # Fires when backward reaches this unit, before any of its ops runs backward.
            out.register_hook(self._before_backward)
''', '''\
        self.free_params()  # THE MISTAKE: and no hook to gather them again for backward
'''),
        ),
        grader_says="backward ran on freed params: all-gather them again"),
    "fsdp_bf16_master_shards": Mistake(
        exercise="fsdp",
        description="Converts the whole module to the compute dtype first, so the master shards "
                    "are bf16 too.",
        edits=(
            ('''\
        # The fp32 master shards: what the optimizer updates, and all this rank keeps.
        # A plain list: they are not the module's parameters (module.parameters() stays the
        # full ones, which is what the block computes with).
        self.shards = [shard_of(p, self.rank, self.world_size).requires_grad_()
                       for p in self.params]
''', '''\
        # THE MISTAKE: the shards are cut from the bf16 params and kept in bf16, so the
        # optimizer updates a bf16 master: small updates round away.
        module.to(self.compute_dtype)
        self.shards = [shard_of(p, self.rank, self.world_size).to(self.compute_dtype)
                       .requires_grad_() for p in self.params]
'''),
            ("flat = torch.zeros(self.world_size * k, dtype=torch.float32)",
             "flat = torch.zeros(self.world_size * k, dtype=self.compute_dtype)"),
            ("recv = torch.empty(send.numel() // self.world_size)",
             "recv = torch.empty(send.numel() // self.world_size, dtype=self.compute_dtype)"),
            ('''\
        recv = torch.empty(self.world_size * send.numel())
''', '''\
        recv = torch.empty(self.world_size * send.numel(), dtype=send.dtype)
'''),
        ),
        grader_says="the master shards stay fp32, whatever the compute dtype"),
    "fsdp_floor_shard_size": Mistake(
        exercise="fsdp",
        description="Shard size numel // world_size (floor): at 3 ranks each parameter's "
                    "remainder is dropped.",
        edits=(
            ('''\
    return -(-numel // world_size)
''', '''\
    # THE MISTAKE: floor, not ceil. 10 elements over 3 ranks: 3 each, and element 9 is
    # in no rank's shard (at 2 ranks every parameter here divides, so nothing shows).
    return numel // world_size
'''),
            ('''\
    flat = torch.zeros(world_size * k, dtype=torch.float32)
    flat[:tensor.numel()] = tensor.detach().reshape(-1)
''', '''\
    flat = tensor.detach().reshape(-1).float()
'''),
        ),
        grader_says="numel // world_size drops the remainder"),
    "fsdp_never_free": Mistake(
        exercise="fsdp",
        description="Never frees the gathered params: every unit stays whole after forward and "
                    "after backward.",
        edits=(
            ('''\
    param.untyped_storage().resize_(0)
''', '''\
    pass  # THE MISTAKE: the storage is never resized to 0
'''),
        ),
        grader_says="after backward (4 of 4): never freed?"),
    "fsdp_no_backward_gather": Mistake(
        exercise="fsdp",
        description="Keeps each unit gathered from its forward to its backward: no free, no "
                    "second all-gather.",
        edits=(
            ('''\
        self.free_params()  # autograd's saved references to the params now point at 0 bytes
        if out.requires_grad:
            # Fires when backward reaches this unit, before any of its ops runs backward.
            out.register_hook(self._before_backward)
''', '''\
        # THE MISTAKE: the full params stay from forward to backward (no free, no second
        # all-gather): right gradients, but every unit stays whole until backward reaches it.
'''),
        ),
        grader_says="0 all-gathers during backward, expected 4"),
    "fsdp_summed_grads": Mistake(
        exercise="fsdp",
        description="Reduce-scatters the gradients with SUM and never divides by world_size.",
        edits=(
            ('''\
        reduce_scatter_flat(recv, send)
        recv /= self.world_size  # the sum over ranks -> the mean: the global batch's gradient
''', '''\
        reduce_scatter_flat(recv, send)  # THE MISTAKE: the sum over ranks, kept as is
'''),
        ),
        grader_says="summed but not averaged? your grad shards are 2.00x the reference"),
    # --- tp ---------------------------------------------------------------------------------------
    "tp_missing_f_backward": Mistake(
        exercise="tp",
        description="Column-parallel layers without f's backward all-reduce: x.grad keeps only "
                    "this rank's part.",
        edits=(
            ('''\
        grad = grad.clone()  # autograd may hand the same tensor to another consumer
        dist.all_reduce(grad)  # SUM: each rank's output slice contributed a part of dL/dx
''', '''\
        # THE MISTAKE: "identity both ways", but every rank's output slice contributed
        # a part of dL/dx: the parts are never added up.
'''),
        ),
        grader_says="f's backward must all-reduce the input gradient"),
    "tp_row_averaged": Mistake(
        exercise="tp",
        description="Row-parallel g averages the ranks' partial sums instead of adding them.",
        edits=(
            ('''\
        dist.all_reduce(out)  # SUM, not AVG: y = sum over ranks of x_r W_r^T
''', '''\
        # THE MISTAKE: averaged as DDP averages gradients; these are partial sums of one
        # matmul: y = sum over ranks of x_r W_r^T, not their mean.
        dist.all_reduce(out)
        out /= dist.get_world_size()
'''),
        ),
        grader_says="averaged the partial sums? g must sum them"),
    "tp_row_reduced_twice": Mistake(
        exercise="tp",
        description="Row-parallel g all-reduces in backward too: its gradients come out "
                    "world_size times too big.",
        edits=(
            ('''\
        return grad  # every rank already holds dL/dy whole: reducing it again would scale it
''', '''\
        # THE MISTAKE: "a collective's backward is the same collective", but every rank
        # already holds dL/dy whole: summing it over ranks scales it by world_size.
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad
'''),
        ),
        grader_says="all-reduced in backward too? g's backward is the identity"),
    "tp_wrong_split_dim": Mistake(
        exercise="tp",
        description="Splits the wrong dim: column-parallel keeps weight columns, row-parallel "
                    "keeps rows.",
        edits=(
            ('''\
        self.weight = my_slice(weight, 0)
''', '''\
        # THE MISTAKE: "column-parallel" read as the columns of weight [out, in], which
        # are its input features; column-parallel splits the output dim (rows).
        self.weight = my_slice(weight, 1)
'''),
            ('''\
        self.weight = my_slice(weight, 1)
''', '''\
        self.weight = my_slice(weight, 0)  # THE MISTAKE, mirrored: rows are output features
'''),
        ),
        grader_says="split the wrong dim? column-parallel splits the output dim"),
    # --- moe --------------------------------------------------------------------------------------
    "moe_recv_as_send": Mistake(
        exercise="moe",
        description="Uses its send counts as its receive counts: output_split_sizes = "
                    "input_split_sizes.",
        edits=(
            ('''\
    recv_splits = recv_counts.view(world_size, num_local).sum(1).tolist()
''', '''\
    # THE MISTAKE: "I get back as many as I send", but recv_counts, not send_counts, say
    # how many rows each peer sends here.
    recv_counts = send_counts
    recv_splits = send_splits
'''),
        ),
        grader_says="each rank used its own send counts as output_split_sizes"),
    "moe_unsorted_combine": Mistake(
        exercise="moe",
        description="Combines without undoing the sort by expert: results land on the wrong "
                    "tokens.",
        edits=(
            ('''\
    gate = weights.flatten()[plan.order, None]  # the weight of each sorted (token, choice)
    out = returned.new_zeros((plan.num_tokens, returned.shape[1]))
    return out.index_add(0, plan.order // top_k, returned * gate)  # undo the sort
''', '''\
    # THE MISTAKE: returned is in sorted-by-expert order, read here as if it were in
    # (token, choice) order: row t gets the results of whichever pairs sorted to 2t, 2t + 1.
    gate = weights.reshape(-1, 1)
    return (returned * gate).view(plan.num_tokens, top_k, -1).sum(1)
'''),
        ),
        grader_says="combine must put each returned row back at the token it came"),
    "moe_unweighted": Mistake(
        exercise="moe",
        description="Forgets the router weights: adds each token's expert outputs unweighted.",
        edits=(
            ('''\
    gate = weights.flatten()[plan.order, None]  # the weight of each sorted (token, choice)
''', '''\
    # THE MISTAKE: the weights never multiply anything: each token gets the plain sum of
    # its k expert outputs.
'''),
            ("returned * gate)", "returned)"),
        ),
        grader_says="multiply each by its router weight"),
    # --- pipeline ---------------------------------------------------------------------------------
    "pipeline_1f1b_warmup_p": Mistake(
        exercise="pipeline",
        description="1F1B with p warm-up forwards on every rank, not p - rank: too many "
                    "microbatches in flight.",
        edits=(
            ("num_warmup = min(num_microbatches, runner.world_size - runner.rank)",
             "num_warmup = min(num_microbatches, runner.world_size)  # fill the whole pipeline"),
        ),
        grader_says="1F1B warms up with min(m, p - rank) = 1 on this stage"),
    "pipeline_gpipe_backward_reversed": Mistake(
        exercise="pipeline",
        description="GPipe's backwards in reverse microbatch order: the grads are right, the "
                    "order is not GPipe's.",
        edits=(
            ('''\
    for i in range(num_microbatches):
        runner.backward(i)
    return runner.finish()
''', '''\
    for i in reversed(range(num_microbatches)):  # the last forward's backward first
        runner.backward(i)
    return runner.finish()
'''),
        ),
        grader_says="backwards in reverse microbatch order (B3 B2 B1 B0)"),
    "pipeline_loss_not_scaled": Mistake(
        exercise="pipeline",
        description="The microbatch losses are not divided by num_microbatches: grads m times "
                    "too large.",
        edits=(
            ('''\
            # The mean over the batch is the mean of equal microbatches' means: scale here,
            # so the gradients accumulated over microbatches need no rescaling afterwards.
            out = self.loss_fn(out, self.targets[i]) / self.num_microbatches
''', '''\
            out = self.loss_fn(out, self.targets[i])  # each microbatch's mean loss
'''),
            ("torch.stack(self.losses).sum()", "torch.stack(self.losses).mean()"),
        ),
        grader_says="your grads are 4.00x the reference: divide each microbatch's"),
    "pipeline_no_grad_sent_back": Mistake(
        exercise="pipeline",
        description="Uses the received activation detached, sends no gradient back: earlier "
                    "stages get no grads.",
        edits=(
            ('''\
            x.requires_grad_()  # so backward fills x.grad, the gradient the sender needs
''', ""),
            ('''\
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=self.rank + 1)
            out.backward(grad)  # the chain rule, continued from the next stage's gradient
        if not self.is_first:
            self.sends.append(dist.isend(x.grad, dst=self.rank - 1))
''', '''\
            out.backward()  # expected to reach every stage's parameters, as in one process
'''),
        ),
        grader_says="stage 0's .grad is None: no gradient came back from stage 1"),
    # --- ring -------------------------------------------------------------------------------------
    "ring_average_merge": Mistake(
        exercise="ring",
        description="Merges the blocks' partial outputs by averaging them, not with the "
                    "log-sum-exp weights.",
        edits=(
            ('''\
    new_lse = torch.logaddexp(lse, block_lse)
    out = (out * torch.exp(lse - new_lse).unsqueeze(-1)
           + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    return out, new_lse
''', '''\
    return (out + block_out) / 2, torch.logaddexp(lse, block_lse)
'''),
        ),
        grader_says="merged by averaging? your out is the plain average"),
    "ring_mask_every_block": Mistake(
        exercise="ring",
        description="Applies the causal mask to every block it computes, not only the diagonal "
                    "one.",
        edits=(
            ('''\
            out, lse = merge(out, lse, *attention_block(q, kv[0], kv[1], scale,
                                                        seen == "diagonal"))
''', '''\
            out, lse = merge(out, lse, *attention_block(q, kv[0], kv[1], scale, causal))
'''),
        ),
        grader_says="the causal mask is applied to every block"),
    "ring_rotate_k_only": Mistake(
        exercise="ring",
        description="Rotates k around the ring but not v: every block pairs its keys with this "
                    "rank's own v.",
        edits=(
            ('''\
    kv = torch.stack([k, v])  # one message per rotation
''', ""),
            ("post_rotation(kv) if", "post_rotation(k) if"),
            ("attention_block(q, kv[0], kv[1], scale,", "attention_block(q, k, v, scale,"),
            ("kv = finish_rotation(in_flight)", "k = finish_rotation(in_flight)"),
        ),
        grader_says="every block used this rank's own v"),
}


def apply_edits(name, reference, edits):
    """`reference` with each (old, new) of `edits` applied. Every old must occur exactly once
    in `reference` (edits do not see each other's results) and no two may overlap."""
    spans = []
    for old, new in edits:
        count = reference.count(old)
        if count != 1:
            raise ValueError(f"wrong solution {name}: an edit's old text occurs {count} times in "
                             f"its reference solution, not once: {old!r}")
        start = reference.index(old)
        spans.append((start, start + len(old), new))
    spans.sort()
    pieces, end = [], 0
    for start, stop, new in spans:
        if start < end:
            raise ValueError(f"wrong solution {name}: two of its edits overlap")
        pieces += [reference[end:start], new]
        end = stop
    return "".join(pieces) + reference[end:]


def with_docstring(source, docstring):
    """`source` with its module docstring replaced by `docstring`, on one line."""
    first = ast.parse(source).body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant), "no docstring"
    return f'"""{docstring}"""\n' + "".join(source.splitlines(keepends=True)[first.end_lineno:])


def build(name):
    """The source of wrong solution `name`: its exercise's reference solution with the edits
    applied, its description as the docstring."""
    mistake = MISTAKES[name]
    reference = (SOLUTIONS / f"{mistake.exercise}.py").read_text()
    return with_docstring(apply_edits(name, reference, mistake.edits), mistake.description)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="name",
                        help="the wrong solution to print (with --write: the ones to write)")
    parser.add_argument("--write", metavar="DIR",
                        help="write DIR/<name>.py for each name given (none given: all of them)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in MISTAKES]
    if unknown:
        parser.error(f"no wrong solution {', '.join(unknown)}; with no arguments it lists them")
    if args.write:
        folder = Path(args.write)
        folder.mkdir(parents=True, exist_ok=True)
        for name in args.names or MISTAKES:
            path = folder / f"{name}.py"
            path.write_text(build(name))
            print(f"python exercises/grade.py {MISTAKES[name].exercise} {path}")
    elif len(args.names) == 1:
        sys.stdout.write(build(args.names[0]))
    elif args.names:
        parser.error("print one at a time, or write several with --write DIR")
    else:
        width = max(map(len, MISTAKES))
        for name, mistake in MISTAKES.items():
            print(f"{name:<{width}}  {mistake.description}")


if __name__ == "__main__":
    main()
