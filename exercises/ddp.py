"""Exercise 1: DDP by hand. Write the gradient averaging that DistributedDataParallel does.

Grade it (the grader starts its own 2 ranks on gloo; plain python, not torchrun):
    python exercises/grade.py ddp

What to build: a wrapper that makes every rank's replica take the same step.
  1. Construction: broadcast rank 0's parameters and buffers, so every replica starts equal.
  2. Backward: each gradient hook (Tensor.register_post_accumulate_grad_hook) notes that its
     parameter's gradient is ready. First make it work one parameter at a time; then group
     parameters into buckets of bucket_bytes and, from the hook of a bucket's last
     parameter, launch ONE all-reduce for the whole bucket with async_op=True, so the
     communication overlaps the rest of backward.
  3. finish_gradient_sync(): wait for every launched all-reduce and write the average over
     ranks into each parameter's .grad.

The contract (what the grader calls, when, and what must hold):
  - The default process group is initialised (gloo, CPU, 2 ranks) before anything here runs.
  - Each rank builds its model with a different seed, then calls
        wrapper = make_ddp(model, bucket_bytes)
    bucket_bytes: None or 0 (one all-reduce per parameter) or a byte count.
    After it returns, every parameter and buffer of `model` equals rank 0's.
  - Each step, on each rank: every param.grad is set to None; `loss = loss_fn(wrapper(tokens),
    targets)` on this rank's equal slice of the global batch (a mean over the slice);
    loss.backward(); then
        finish_gradient_sync(wrapper)
    After it returns, for every parameter p of `model` with p.requires_grad, p.grad holds
    the average over ranks of the local gradients, which is the gradient of the loss on the
    whole global batch (fp32, within 1e-5 of one process). The grader reads the .grad of
    `model`'s own parameters: keep the module you were given, do not copy it.
  - Parameters with requires_grad=False: leave them alone; their .grad stays None. (You may
    not register a gradient hook on them: torch refuses.)
  - Tied weights: a Parameter used twice (here the embedding's weight is also the output
    layer's) gets ONE gradient, the sum over its uses, and one hook call: reduce it once.
    model.parameters() yields it once.
  - Communication: exactly one torch.distributed.all_reduce per bucket per step (the grader
    counts the calls; call it as dist.all_reduce). The buckets:
      take the trainable parameters in reverse order of model.parameters() (roughly the
      order backward produces their gradients); put them in a bucket in that order; close
      the bucket when adding the next parameter would take it over bucket_bytes (bytes =
      p.numel() * p.element_size()), so a parameter bigger than bucket_bytes gets a bucket
      of its own; bucket_bytes None or 0: every parameter is its own bucket.
    With buckets, launch each bucket's all-reduce from a gradient hook while backward is
    still running, with async_op=True (a synchronous all-reduce blocks backward), and wait
    in finish_gradient_sync. Any bucket whose gradients are ready before backward's last
    gradient must be launched before it.
  - Every trainable parameter gets a gradient every step (no unused parameters), and there is
    one backward per finish_gradient_sync (no gradient accumulation): reset what you count
    per step so the next step starts clean.
  - Averaging: sum over ranks (ReduceOp.SUM), then divide by world_size, once per gradient.

The adapter: the grader calls only the two module-level names at the end of this file,
make_ddp(model, bucket_bytes) -> wrapper and finish_gradient_sync(wrapper). Your class and
methods may have any names: point the two at your own code, e.g.
    make_ddp = MyWrapper
    def finish_gradient_sync(wrapper):
        wrapper.wait_for_grads()
The wrapper must be callable like the model (the grader runs forward as wrapper(tokens)).

Lesson: lessons/01_ddp.py. A solution: exercises/solutions/ddp.py (try first).
"""

import torch
import torch.distributed as dist


class HandDDP(torch.nn.Module):
    """Wraps `module`: same start on every rank, gradients averaged over ranks."""

    def __init__(self, module, bucket_bytes=None):
        super().__init__()
        self.module = module
        raise NotImplementedError(
            "implement HandDDP.__init__: broadcast rank 0's parameters and buffers, plan the "
            "buckets, register a gradient hook on each trainable parameter")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param):
        """Gradient hook: param.grad is complete. Launch its bucket if it is the last."""
        raise NotImplementedError(
            "implement HandDDP._grad_ready: count the bucket's ready gradients; launch "
            "dist.all_reduce(..., async_op=True) for the bucket when the last one is ready")

    def finish_gradient_sync(self):
        """Called once after each backward: wait, average, write into each .grad."""
        raise NotImplementedError(
            "implement HandDDP.finish_gradient_sync: wait for every launched all-reduce, "
            "divide by world_size, copy the results into .grad, reset for the next step")


# The grader's entry points (the adapter). Keep these two names; point them at your code.
make_ddp = HandDDP


def finish_gradient_sync(wrapper):
    wrapper.finish_gradient_sync()
