"""The final capstone's starting point: a small transformer, trained in one process, that
stops and resumes. Port it to 2-D parallelism: tensor parallel inside, FSDP across.

Your task (docs/onboarding.md, "Final capstone"): make a copy that runs under torchrun on 4
ranks as a 2 x 2 mesh ("dp", "tp"), trains the same model on the same global batches, and
saves and resumes a sharded checkpoint. Keep the command-line contract below;
`python capstone/grade.py --final your_port.py` runs your port in two legs, stopped at
--stop-at-step then resumed, and compares it with this script run in one process.

    python capstone/train_transformer.py --out runs/lm --stop-at-step 6   # trains 6 steps, saves
    python capstone/train_transformer.py --out runs/lm                    # resumes, trains to 12

Contract (what the grader reads), in --out DIR:
- `losses.json`: every trained step's loss (the mean over the global batch), from step 1 to the
  last one trained, across restarts;
- `checkpoint/`: a torch.distributed.checkpoint (DCP) directory holding "model" and "optim"
  (get_state_dict's fully qualified names) and "step", saved at --stop-at-step and after the
  last step. When DIR/checkpoint exists at start, the run resumes from it.
"""

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

VOCAB, DIM, NUM_HEADS, NUM_LAYERS, SEQ_LEN = 64, 32, 4, 2, 16
NUM_SEQUENCES = 256


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps in all, across restarts")
    parser.add_argument("--stop-at-step", type=int, default=None,
                        help="save a checkpoint after this step and exit (a planned stop)")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate after warmup")
    parser.add_argument("--warmup-steps", type=int, default=4,
                        help="linear warmup from 0 (why: lesson 03, AdamW's first step)")
    parser.add_argument("--seed", type=int, default=0, help="init and data")
    parser.add_argument("--out", required=True, help="where losses.json and checkpoint/ go")
    return parser.parse_args(argv)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads = NUM_HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        head_dim = DIM // NUM_HEADS
        q, k, v = (w(x).view(batch, seq, self.num_heads, head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.num_heads * head_dim))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(NUM_LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build_model(seed):
    torch.manual_seed(seed)
    return Transformer()


def make_dataset(seed):
    """NUM_SEQUENCES token sequences that follow a fixed random rule, so the loss can fall: each
    token picks the next from a few likely successors. The same on every run and every rank."""
    generator = torch.Generator().manual_seed(seed + 1000)
    successors = torch.randint(0, VOCAB, (VOCAB, 3), generator=generator)
    tokens = torch.empty(NUM_SEQUENCES, SEQ_LEN + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (NUM_SEQUENCES,), generator=generator)
    for position in range(SEQ_LEN):
        pick = torch.randint(0, 3, (NUM_SEQUENCES,), generator=generator)
        tokens[:, position + 1] = successors[tokens[:, position], pick]
    return tokens


def global_batch(dataset, step, batch_size, seed):
    """The sequences of step `step` (from 1): a fixed function of the step, so a resumed run
    needs only the step to go on with the right data."""
    steps_per_epoch = len(dataset) // batch_size
    epoch, index = divmod(step - 1, steps_per_epoch)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch))
    return dataset[order[index * batch_size:(index + 1) * batch_size]]


def lr_at(step, args):
    """Linear warmup from 0 at step 1 to args.lr, then constant."""
    return args.lr * min(1.0, (step - 1) / args.warmup_steps) if args.warmup_steps else args.lr


def train_step(model, optimizer, tokens, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def save_checkpoint(out, model, optimizer, step):
    """DCP into checkpoint.tmp, then renamed to checkpoint: a crash mid-save leaves the last
    complete checkpoint (or none), never half of one."""
    model_state, optim_state = get_state_dict(model, optimizer)
    tmp, final = out / "checkpoint.tmp", out / "checkpoint"
    shutil.rmtree(tmp, ignore_errors=True)
    dcp.save({"model": model_state, "optim": optim_state, "step": step}, checkpoint_id=tmp,
             no_dist=True)  # one process, no process group
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def load_checkpoint(out, model, optimizer):
    """The step the checkpoint in out was saved after; the model and optimizer restored."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": 0}
    dcp.load(state, checkpoint_id=out / "checkpoint", no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return state["step"]


def read_losses(out, up_to_step):
    path = out / "losses.json"
    return json.loads(path.read_text())[:up_to_step] if path.exists() else []


def write_losses(out, losses):
    tmp = out / "losses.json.tmp"
    tmp.write_text(json.dumps(losses))
    tmp.replace(out / "losses.json")


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    done = load_checkpoint(out, model, optimizer) if (out / "checkpoint").exists() else 0
    losses = read_losses(out, done)
    dataset = make_dataset(args.seed)
    last = min(args.steps, args.stop_at_step or math.inf)
    for step in range(done + 1, last + 1):
        tokens = global_batch(dataset, step, args.batch_size, args.seed)
        losses.append(train_step(model, optimizer, tokens, lr_at(step, args)).item())
    write_losses(out, losses)  # first: a crash before the checkpoint rereads only `done` of them
    save_checkpoint(out, model, optimizer, last)
    print(f"trained steps {done + 1} to {last}, last loss {losses[-1]:.4f}, saved to {out}")


if __name__ == "__main__":
    main()
