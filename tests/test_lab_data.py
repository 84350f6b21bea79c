"""--data FILE: the labs train on a real file, a text read as bytes or a binary token file,
memory-mapped with torch alone; bad files are refused before any process group; windows are
shuffled per epoch and a resumed run is bit-identical to an uninterrupted one."""

import array
import os
import subprocess

import pytest
import torch

from labkit.data import TokenWindows, dataset_length
from launcher import LABS, PYTHON, REPO, load_script, run_lab

LOSS_BOUND = 0.5  # ln(256) = 5.55 at the start; the debug model gets below 0.2 in 40 steps
WORDS = ("the quick brown fox jumps over the lazy dog while a patient cat watches from the "
         "warm window").split()


def write_corpus(path, lines=400):
    """A text whose next byte is predictable from the last few: rotations of one sentence."""
    text = "".join(" ".join(WORDS[i % len(WORDS):] + WORDS[:i % len(WORDS)]) + ".\n"
                   for i in range(lines))
    path.write_text(text)
    return path


def write_tokens(path, tokens, typecode):
    with open(path, "wb") as f:
        array.array(typecode, tokens).tofile(f)
    return path


@pytest.fixture(scope="module")
def lab01():
    return load_script(LABS / "lab01_ddp.py")


@pytest.mark.parametrize("lab, nproc", [("lab01_ddp", 2), ("lab02_fsdp", 2)])
def test_a_text_file_trains(lab, nproc, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    _, metrics = run_lab(lab, nproc, ["--data", corpus, "--steps", "40"], tmp_path)
    assert metrics["config"]["vocab_size"] == 256  # bytes
    assert metrics["losses"][0][1] > 4.0 and metrics["final_loss"] < LOSS_BOUND, metrics["losses"]


def test_resume_on_a_text_file_is_bit_identical(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=60)  # a few epochs in 40 steps
    common = ["--data", corpus, "--steps", "40", "--seq-len", "16"]
    _, straight = run_lab("lab02_fsdp", 2, common, tmp_path)
    ckpt = tmp_path / "ckpt"
    run_lab("lab02_fsdp", 2, [*common, "--checkpoint-dir", ckpt, "--stop-at-step", "17"], tmp_path)
    _, resumed = run_lab("lab02_fsdp", 2, [*common, "--checkpoint-dir", ckpt], tmp_path)
    assert resumed["losses"][0][0] == 18
    assert resumed["losses"] == straight["losses"][17:]  # exact: no tolerance


def test_windows_are_shuffled_differently_each_epoch(lab01, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=20)
    cfg = lab01.parse_config(["--data", str(corpus), "--micro-batch-size", "1"])
    per_epoch = dataset_length(cfg)  # one window per batch: an epoch uses them all
    batches = lab01.micro_batches(cfg, 0, 1, 0)
    epochs = [[next(batches)[0] for _ in range(per_epoch)] for _ in range(2)]
    first, second = (torch.cat(e) for e in epochs)
    assert not torch.equal(first, second)  # another order
    assert sorted(map(tuple, first.tolist())) == sorted(map(tuple, second.tolist()))  # same windows


@pytest.mark.parametrize("dtype, typecode, top", [("uint16", "H", 60_000), ("uint32", "I", 100_000)])
def test_binary_token_files_are_memory_mapped_by_dtype(lab01, tmp_path, dtype, typecode, top):
    tokens = [(7 * i) % top for i in range(5000)] + [top - 1]
    path = write_tokens(tmp_path / "train.bin", tokens, typecode)
    cfg = lab01.parse_config(["--data", str(path), "--data-dtype", dtype, "--vocab-size", str(top)])
    dataset = TokenWindows(cfg.data, cfg.seq_len, cfg.data_dtype)
    assert len(dataset) == (len(tokens) - 1) // cfg.seq_len
    inputs, targets = dataset[3]
    start = 3 * cfg.seq_len
    assert inputs.tolist() == tokens[start:start + cfg.seq_len]
    assert targets.tolist() == tokens[start + 1:start + cfg.seq_len + 1]
    assert inputs.dtype == torch.int64


def test_a_token_file_trains_under_torchrun(tmp_path):
    tokens = [(3 * i + i // 7) % 97 for i in range(20_000)]
    path = write_tokens(tmp_path / "train.bin", tokens, "H")
    _, metrics = run_lab("lab03_tp_fsdp", 2, ["--data", path, "--vocab-size", "128",
                                              "--steps", "20"], tmp_path)
    assert metrics["final_loss"] < metrics["losses"][0][1] - 1.0


def refused(args, tmp_path):
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    proc = subprocess.run([PYTHON, str(LABS / "lab01_ddp.py"), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    return lines[0]


def test_bad_data_files_are_refused_in_one_line(tmp_path):
    assert "no such file" in refused(["--data", tmp_path / "missing.bin"], tmp_path)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    assert "not a whole number of uint16 tokens" in refused(["--data", odd], tmp_path)
    big = write_tokens(tmp_path / "big.bin", [5, 700, 3] * 100, "H")
    assert "holds token id 700, but --vocab-size is 64" in refused(["--data", big], tmp_path)
    tiny = write_corpus(tmp_path / "tiny.txt", lines=1)
    assert "fewer than one global batch" in refused(["--data", tiny], tmp_path)
