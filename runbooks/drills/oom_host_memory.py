"""Drill: a HOST (CPU RAM) allocation failure, which is not a CUDA OOM.

Runbook: runbooks/oom-reading-the-error.md ("looks similar but isn't").
    python runbooks/drills/oom_host_memory.py
Asks the CPU allocator for 1 PiB. The failure is a plain RuntimeError from DefaultCPUAllocator,
so `except torch.OutOfMemoryError` does not catch it, and none of the CUDA fixes apply: look at
host RAM (DataLoader workers, pinned buffers, a checkpoint loaded onto the CPU) instead.
"""

import torch


def host_oom_message(num_bytes=2**50):
    try:
        torch.empty(num_bytes, dtype=torch.uint8)
    except torch.OutOfMemoryError as exc:  # not reached on Linux: see the docstring
        return f"torch.OutOfMemoryError: {exc}"
    except RuntimeError as exc:
        return f"{type(exc).__name__} (not torch.OutOfMemoryError): {exc}"
    return f"allocated {num_bytes} bytes: this machine did not fail"


if __name__ == "__main__":
    print(host_oom_message())
