"""GPipe's backwards in reverse microbatch order: the grads are right, the order is not GPipe's."""


import torch
import torch.distributed as dist


class StageRunner:
    """This rank's stage, one microbatch at a time. `saved` holds the activations in flight:
    each microbatch's input and output (loss on the last stage), from its forward until its
    backward; its length is what 1F1B keeps small."""

    def __init__(self, stage, inputs, targets, loss_fn, num_microbatches, record):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_first, self.is_last = self.rank == 0, self.rank == self.world_size - 1
        self.stage, self.loss_fn, self.record = stage, loss_fn, record
        self.num_microbatches = num_microbatches
        self.inputs = inputs.chunk(num_microbatches)
        self.targets = targets.chunk(num_microbatches)
        self.saved = {}  # microbatch -> (input, output): alive from its forward to its backward
        self.sends = []  # isend works: a blocking send on gloo waits for the peer's receive
        self.losses = []

    def forward(self, i):
        self.record("F", i)
        if self.is_first:
            x = self.inputs[i]
        else:
            x = torch.empty_like(self.inputs[i])  # every activation has a microbatch's shape
            dist.recv(x, src=self.rank - 1)
            x.requires_grad_()  # so backward fills x.grad, the gradient the sender needs
        out = self.stage(x)
        if self.is_last:
            # The mean over the batch is the mean of equal microbatches' means: scale here,
            # so the gradients accumulated over microbatches need no rescaling afterwards.
            out = self.loss_fn(out, self.targets[i]) / self.num_microbatches
            self.losses.append(out.detach())
        else:
            self.sends.append(dist.isend(out.detach(), dst=self.rank + 1))
        self.saved[i] = (x, out)

    def backward(self, i):
        self.record("B", i)
        x, out = self.saved.pop(i)  # the activations of microbatch i are freed after this
        if self.is_last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=self.rank + 1)
            out.backward(grad)  # the chain rule, continued from the next stage's gradient
        if not self.is_first:
            self.sends.append(dist.isend(x.grad, dst=self.rank - 1))

    def finish(self):
        for work in self.sends:
            work.wait()
        return torch.stack(self.losses).sum().item() if self.is_last else None


def run_gpipe(stage, inputs, targets, loss_fn, num_microbatches, record):
    """All forwards, then all backwards in microbatch order (torch's ScheduleGPipe)."""
    runner = StageRunner(stage, inputs, targets, loss_fn, num_microbatches, record)
    for i in range(num_microbatches):
        runner.forward(i)
    for i in reversed(range(num_microbatches)):  # the last forward's backward first
        runner.backward(i)
    return runner.finish()


def run_1f1b(stage, inputs, targets, loss_fn, num_microbatches, record):
    """p - rank warm-up forwards, then one backward and one forward at a time (torch's
    Schedule1F1B): rank r never holds more than p - r microbatches' activations."""
    runner = StageRunner(stage, inputs, targets, loss_fn, num_microbatches, record)
    num_warmup = min(num_microbatches, runner.world_size - runner.rank)
    for i in range(num_warmup):
        runner.forward(i)
    for i in range(num_microbatches):
        runner.backward(i)
        if num_warmup + i < num_microbatches:
            runner.forward(num_warmup + i)
    return runner.finish()
