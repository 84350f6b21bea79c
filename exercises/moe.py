"""Exercise 7: MoE dispatch and combine. Send tokens to experts on other ranks and back.

Grade it (the grader starts its own ranks, 2 and then 3, on gloo; plain python, not torchrun):
    python exercises/grade.py moe

What to build: the communication of an expert-parallel mixture-of-experts layer. The router
has already chosen each token's k = 2 experts; the experts live on different ranks.
  1. dispatch: sort this rank's (token, choice) pairs by expert (that groups them by
     destination rank), exchange the counts, then send the rows with one uneven
     dist.all_to_all_single (input_split_sizes / output_split_sizes).
  2. run_experts: each local expert on the rows it received.
  3. combine: the reverse all-to-all brings the results home; weight each by its router
     weight and add them up at the token they came from, in the original token order.
The all-to-alls must carry gradients back: write AllToAllSingle, an autograd.Function whose
forward is dist.all_to_all_single and whose backward is the same exchange with the split sizes
swapped (what rank s sent you, its gradient goes back to rank s).
Why by hand: torch 2.13 has a differentiable torch.distributed.nn.functional.all_to_all_single
and it works on gloo, but it is deprecated (FutureWarning) in favour of the private
torch.distributed._functional_collectives, which calls c10d directly, so the grader cannot see
it. Writing the Function is ten lines and is the lesson: backward of an all-to-all is an
all-to-all. (The deprecated one calls dist.all_to_all_single and would pass too.)

The contract (what the grader calls, when, and what must hold):
  - The default process group is initialised (gloo, CPU; 2 ranks, then 3) before anything
    here runs.
  - Each rank calls
        out = moe_forward(tokens, expert_ids, weights, local_experts)
    tokens [T, dim] fp32 (requires grad): this rank's tokens; T differs between ranks.
    expert_ids [T, k] int64: the global experts of each token, k = 2 distinct ones.
    weights [T, k] fp32 (requires grad): the router's probability of each chosen expert,
    renormalised over the k (each row sums to 1).
    local_experts: a torch.nn.ModuleList of this rank's experts_per_rank = len(local_experts)
    experts. Expert e lives on rank e // experts_per_rank, as its local_experts[e %
    experts_per_rank]; there are experts_per_rank * world_size experts. An expert maps rows
    [n, dim] -> [n, dim], each row on its own (n may be 0); call it as expert(rows).
  - out [T, dim], row t for token t (the original order):
        out[t] = sum over j of weights[t, j] * expert_{expert_ids[t, j]}(tokens[t])
    fp32, within 1e-5 of one process running every token through its experts. The grader
    then back-propagates sum(out * upstream); tokens.grad, weights.grad and every local
    expert's parameters' .grad must equal one process's (fp32, within 1e-5).
  - Communication: dist.all_to_all_single only, called as dist.all_to_all_single (the grader
    watches the calls), exactly 3 per forward and 2 per backward:
      1. the counts: a tensor of this rank's row counts per destination rank (world_size
         numbers) or per destination expert (world_size * experts_per_rank numbers, in
         expert order), with no split sizes (an even split);
      2. dispatch: one row per (token, choice), grouped by destination rank in rank order, so
         a token whose 2 experts live on one rank goes there twice; input_split_sizes[r] =
         rows this rank sends to rank r, output_split_sizes[r] = rows rank r sends here (from
         the counts you received, not the ones you send);
      3. combine: the same exchange with the two split lists swapped.
    Backward: the reverse of combine, then of dispatch (AllToAllSingle.backward does it).
    The ranks must agree on every split: rank s's input_split_sizes[d] is rank d's
    output_split_sizes[s]. (On gloo a mismatch aborts the process; the grader checks first.)
  - A rank may send 0 rows to a peer, and receive 0 from one (the 3-rank checks do).

The adapter: the grader calls only moe_forward(tokens, expert_ids, weights, local_experts)
-> out, the module-level name at the end of this file. Your functions may have any names and
shapes: the three steps below are a suggestion; point moe_forward at your own code.

Lesson: lessons/08_expert_parallel.py (Expert parallelism, by hand) and lessons/moe_workers.py.
A solution: exercises/solutions/moe.py (try first).
"""

import torch
import torch.distributed as dist


class AllToAllSingle(torch.autograd.Function):
    """dist.all_to_all_single that carries gradients: backward sends them back where the rows
    came from (the same exchange, split sizes swapped)."""

    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes):
        raise NotImplementedError(
            "implement AllToAllSingle.forward: save the splits, allocate the output "
            "(sum(output_split_sizes) rows), dist.all_to_all_single into it")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(
            "implement AllToAllSingle.backward: dist.all_to_all_single of grad with the split "
            "sizes swapped; return (grad_input, None, None)")


def dispatch(tokens, expert_ids, num_local):
    """Send each (token, choice) row to its expert's rank. Returns (the rows received, a plan
    of your own: whatever run_experts and combine need)."""
    raise NotImplementedError(
        "implement dispatch: sort the (token, choice) pairs by expert, exchange the counts "
        "with dist.all_to_all_single, then send the rows with AllToAllSingle")


def run_experts(received, plan, local_experts):
    """Each local expert on the rows it received; outputs in the rows' received order."""
    raise NotImplementedError(
        "implement run_experts: find each received row's local expert from the counts, run "
        "each expert on its rows")


def combine(outputs, weights, plan):
    """The reverse all-to-all, then weights[t, j] times each result, added at token t."""
    raise NotImplementedError(
        "implement combine: AllToAllSingle with dispatch's splits swapped, multiply by the "
        "weights, add each result at its token (undo the sort)")


# The grader's entry point (the adapter). Keep this name; point it at your code.
def moe_forward(tokens, expert_ids, weights, local_experts):
    received, plan = dispatch(tokens, expert_ids, len(local_experts))
    outputs = run_experts(received, plan, local_experts)
    return combine(outputs, weights, plan)
