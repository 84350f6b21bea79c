"""Reference solution: try exercises/moe.py first; read this after the grader has had its say.

Expert parallelism by hand: sort this rank's (token, choice) pairs by expert, which groups them
by destination rank; exchange the counts; send the rows with an uneven all_to_all_single; run
the local experts; send the results back with the reverse all-to-all; weight them and add them
up at their tokens. The contract is in exercises/moe.py.

    python exercises/grade.py moe exercises/solutions/moe.py
"""

from typing import NamedTuple

import torch
import torch.distributed as dist


class AllToAllSingle(torch.autograd.Function):
    """dist.all_to_all_single with a backward: the gradient of what rank s sent here goes back
    to rank s, so backward is the same exchange with the split sizes swapped."""

    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes):
        ctx.splits = output_split_sizes, input_split_sizes
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_split_sizes, input_split_sizes = ctx.splits
        grad_in = grad.new_empty((sum(input_split_sizes), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), input_split_sizes, output_split_sizes)
        return grad_in, None, None


class Plan(NamedTuple):
    """What combine needs from dispatch."""
    order: torch.Tensor  # sorted position i holds (token, choice) pair order[i] (token-major)
    send_splits: list  # rows sent to each rank
    recv_splits: list  # rows received from each rank
    recv_counts: torch.Tensor  # [world_size, num_local]: rows from rank s for local expert j
    num_tokens: int


def dispatch(tokens, expert_ids, num_local):
    """Send every (token, choice) row to the rank of its expert. Returns the rows received
    (from rank 0 first; within a source, by local expert) and the plan to bring them back."""
    world_size, top_k = dist.get_world_size(), expert_ids.shape[1]
    flat = expert_ids.flatten()
    # Sorting by expert sorts by destination rank too: expert e lives on rank e // num_local.
    order = torch.argsort(flat, stable=True)
    send_counts = torch.bincount(flat, minlength=num_local * world_size)
    # Counts first: nobody can size its receive buffer, or know which rows are whose,
    # without them. Even splits: num_local counts to each rank.
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send_splits = send_counts.view(world_size, num_local).sum(1).tolist()
    recv_splits = recv_counts.view(world_size, num_local).sum(1).tolist()
    received = AllToAllSingle.apply(tokens[order // top_k], recv_splits, send_splits)
    return received, Plan(order, send_splits, recv_splits,
                          recv_counts.view(world_size, num_local), tokens.shape[0])


def run_experts(received, plan, local_experts):
    """Each local expert on its rows; the outputs stay where their rows were."""
    world_size, num_local = plan.recv_counts.shape
    # received is [from rank 0: expert 0's rows, expert 1's rows, ...; from rank 1: ...]
    expert_of = torch.arange(num_local).repeat(world_size).repeat_interleave(
        plan.recv_counts.flatten())
    outputs = torch.zeros_like(received)
    for j, expert in enumerate(local_experts):
        rows = (expert_of == j).nonzero(as_tuple=True)[0]
        if rows.numel():
            outputs = outputs.index_copy(0, rows, expert(received[rows]))
    return outputs


def combine(outputs, weights, plan):
    """The reverse all-to-all brings the results back in this rank's sorted order; each is
    weighted and added at the token it came from."""
    returned = AllToAllSingle.apply(outputs, plan.send_splits, plan.recv_splits)
    top_k = weights.shape[1]
    gate = weights.flatten()[plan.order, None]  # the weight of each sorted (token, choice)
    out = returned.new_zeros((plan.num_tokens, returned.shape[1]))
    return out.index_add(0, plan.order // top_k, returned * gate)  # undo the sort


def moe_forward(tokens, expert_ids, weights, local_experts):
    received, plan = dispatch(tokens, expert_ids, len(local_experts))
    outputs = run_experts(received, plan, local_experts)
    return combine(outputs, weights, plan)
