"""lessons/fsdp1_train.py and its FSDP2 port train the same model. FSDP1 needs GPUs (its
constructor refuses a CPU-only machine, asserted by lesson 02), so the comparison is GPU only;
lesson 02 runs the port on CPU against a single process."""

import pytest
import torch

from launcher import PYTHON, REPO, run

LESSONS = REPO / "lessons"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP1 needs CUDA: 2 GPUs (NCCL)")
def test_fsdp1_and_its_fsdp2_port_train_the_same_parameters(tmp_path):
    for name in ("fsdp1_train", "fsdp2_train"):
        run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(LESSONS / f"{name}.py"), str(tmp_path / f"{name}.pt"), "--param-dtype",
             "float32"], timeout=300)
    fsdp1 = torch.load(tmp_path / "fsdp1_train.pt", weights_only=True)
    fsdp2 = torch.load(tmp_path / "fsdp2_train.pt", weights_only=True)
    assert fsdp1.keys() == fsdp2.keys()
    assert max((fsdp1[k].float() - fsdp2[k].float()).abs().max().item() for k in fsdp1) <= 1e-5


def top_level_block(source, header):
    """The text of one top-level def/class, from its header to the next blank-blank line."""
    start = source.index(header)
    return source[start:source.index("\n\n\n", start)]


def test_the_two_scripts_differ_only_in_the_parallel_wrapper():
    """The port keeps the model, data and loop: only imports, wrapping and saving change."""
    one, two = ((LESSONS / f"{n}.py").read_text() for n in ("fsdp1_train", "fsdp2_train"))
    for header in ("class Block(torch.nn.Module):", "def build_model():",
                   "def batches(rank, world_size):"):
        assert top_level_block(one, header) == top_level_block(two, header), header
    assert "FullyShardedDataParallel" in one and "fully_shard(" in two
    assert "FullyShardedDataParallel" not in two
