"""What each lab's docstring promises about its own run, checked against a real run; and the
course runner's summary line. (The CUDA-only choices are tested in test_gpu_defaults.py.)"""

import re
import sys
from pathlib import Path

import pytest
import torch

from launcher import LABS, PYTHON, REPO, load_script, run_all, shared_lab_run

sys.path.insert(0, str(REPO / "tools"))
LAB_PATHS = sorted(LABS.glob("lab[0-9][0-9]_*.py"))
EXPECTED = re.compile(r"^    (done \| (lab\w+) \| gloo x(\d+) \| (\d+) steps \| loss (\d\.\d+)\.\.\. \|"
                      r" parity (\S+) \| \.\.\.)$", re.M)


def expected_line(lab_path):
    found = EXPECTED.findall(lab_path.read_text())
    assert len(found) == 1, f"{lab_path.name}: one 'Expected last line' in the docstring"
    line, name, nproc, steps, loss_prefix, parity = found[0]
    assert name == lab_path.stem
    return int(nproc), int(steps), loss_prefix, parity


@pytest.mark.parametrize("lab_path", LAB_PATHS, ids=lambda p: p.stem)
def test_docstring_expected_last_line_matches_a_run(lab_path, tmp_path):
    """The docstring's run (the defaults plus --check-parity, at its world size) ends with the
    loss it shows, to the digits it shows, and the parity it states is within the limit."""
    nproc, steps, loss_prefix, parity = expected_line(lab_path)
    proc, metrics = shared_lab_run(lab_path.stem, nproc, ["--check-parity"])
    done = [line for line in proc.stdout.splitlines() if line.startswith("done | ")][-1]
    assert f"| gloo x{nproc} | {steps} steps | loss {loss_prefix}" in done, done
    assert float(parity) <= metrics["parity_tol"] and metrics["parity_max_abs_diff"] <= 1e-5


def test_every_lab_refuses_a_non_finite_number_before_any_process_group():
    """The shared validation, in every lab: NaN passes every "> 0" check, and used to surface
    as a traceback from AdamW on every rank after the process group started."""
    procs = run_all([[PYTHON, str(lab), "--lr", "nan"] for lab in LAB_PATHS], timeout=120,
                    envs=[{"WORLD_SIZE": str(expected_line(lab)[0])} for lab in LAB_PATHS])
    for lab, proc in zip(LAB_PATHS, procs):
        assert proc.returncode == 2 and proc.stdout == "", (lab.name, proc.stdout, proc.stderr)
        assert proc.stderr.strip() == f"{lab.name}: error: --lr: must be a finite number, got nan"


def test_course_runner_prints_the_summary_line_not_a_later_warning(tmp_path):
    import course

    log = tmp_path / "lab.log"
    log.write_text("step 40 | loss 0.5\ndone | lab03_tp_fsdp | gloo x2 | 40 steps | loss 0.46\n"
                   "[rank0]:W... 2 sequential all_reduce operations will be performed\n")
    assert course.summary_of(log) == "done | lab03_tp_fsdp | gloo x2 | 40 steps | loss 0.46"
    log.write_text("Traceback ...\n")
    assert course.summary_of(log).startswith("(no summary line")


def test_course_summary_reports_mfu_against_its_peak():
    import course

    row = {"lab": "lab01_ddp", "backend": "gloo", "world_size": 2, "steps": 40,
           "final_loss": 0.46, "parity_max_abs_diff": 0.0, "parity_tol": 1e-5,
           "tokens_per_s": 50000.0, "peak_mem_bytes_per_rank": [2**30, 2**30],
           "wall_time_s": 1.2, "mfu": 0.198,
           "peak_source": "measured here: fp32 512x512 matmul on 1 thread(s) per rank"}
    gpu = {**row, "mfu": 0.412, "peak_source": "H100-80GB datasheet, bf16 dense"}
    unknown = {**row, "mfu": None, "peak_source": "no GPU_SPECS entry for X"}
    table = course.summary_table([row, gpu, unknown])
    assert "| MFU " in table.splitlines()[0]
    assert "19.8% of CPU matmul peak" in table and "41.2% of H100-80GB datasheet" in table
    assert "n/a (no GPU_SPECS entry for X)" in table


@pytest.mark.parametrize("lab_path", LAB_PATHS, ids=lambda p: p.stem)
def test_docstring_commands_keep_their_line_continuations(lab_path):
    """In a non-raw docstring a single trailing backslash joins two lines of a command into
    one; the page and --help would show a command nobody can paste. Write it as two."""
    source = lab_path.read_text()
    docstring = source[:source.index('"""', 3)]
    joined = [line for line in docstring.splitlines() if re.search(r"(?<!\\)\\$", line)]
    assert joined == []


def test_the_cpu_memory_figure_is_in_bytes_on_linux_and_macos():
    """ru_maxrss is in kilobytes on Linux and in bytes on macOS: the log's `mem` must be bytes
    on both (the onboarding page promises macOS)."""
    from labkit.loop import maxrss_unit_bytes, peak_memory_bytes

    assert maxrss_unit_bytes("darwin") == 1 and maxrss_unit_bytes("linux") == 1024
    peak = peak_memory_bytes(torch.device("cpu"))
    if sys.platform.startswith("linux"):  # the kernel's own figure, in kB
        status = Path("/proc/self/status").read_text()
        high_water_kb = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))
        assert abs(peak - high_water_kb * 1024) <= 0.05 * peak, (peak, high_water_kb)
