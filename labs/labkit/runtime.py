"""Device and precision, process-group init and teardown, and the device mesh, each wait with
a timeout. lab01 writes its own init_process_group out, because that is what it teaches; the
other labs call init_distributed() here."""

import datetime
import gc
import math
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def world_size_from_env():
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size():
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def pick_device_type(cfg):
    if cfg.device != "auto":
        return cfg.device
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size()
    return "cuda" if enough_gpus else "cpu"


def cuda_has_bf16():
    # In hardware from Ampere (sm_80) on; V100 and T4 would emulate it, slowly.
    return torch.cuda.is_bf16_supported(including_emulation=False)


def choose_precision(requested, device_type, has_bf16):
    """--amp and the device's capabilities -> the compute dtype, None meaning fp32. Pure, so a
    test can drive it with any device it fakes."""
    if requested == "off" or (requested == "auto" and device_type != "cuda"):
        return None  # CPU: fp32 keeps parity within 1e-5, and CPU bf16 matmuls are rarely faster
    if requested == "auto":
        # bf16 has fp32's exponent range, so no loss scaling; fp16 needs a GradScaler.
        return torch.bfloat16 if has_bf16 else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[requested]


def compute_dtype(cfg, device_type):
    return choose_precision(cfg.amp, device_type, device_type != "cuda" or cuda_has_bf16())


def precision_name(dtype):
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16 + GradScaler"}[dtype]


def make_grad_scaler(dtype, device):
    """fp16 gradients underflow without loss scaling; bf16 and fp32 do not. Disabled, the
    scaler passes every call straight through (no scaling, no host sync). Enabled, its step()
    reads found_inf on the host: one sync per step, the price of fp16. On FSDP's DTensor
    gradients the inf check is reduced over the mesh, so every rank skips the same steps."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def become_a_world_of_one():
    """Without torchrun there is no RANK: set what torchrun would set for a single process."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def attempt_store(rank, world_size, timeout):
    """The rendezvous store that env:// would give us, with keys namespaced by restart attempt.

    torchrun (c10d rendezvous, torch <= 2.13 at least) hands every restart attempt the same
    TCPStore, so a restarted worker can read the dead attempt's gloo/NCCL addresses and fail
    ("Gloo connectFullMesh failed ... Connection refused") or hang. See runbooks/restart-hang.md.
    """
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=hosts_store, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt{attempt}/", store)


def init_distributed(cfg):
    """lab01's init_distributed, for the labs that teach something else: returns (rank,
    world_size, device) with the group's timeout set to --timeout-s."""
    become_a_world_of_one()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_gpu = pick_device_type(cfg) == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)  # before any tensor lands on plain "cuda" (= cuda:0)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timeout, rank=rank,
                            store=attempt_store(rank, world_size, timeout),
                            world_size=world_size, device_id=device if on_gpu else None)
    return rank, world_size, device


def teardown_distributed():
    """Destroy the process group after everything that holds it is gone. Call it in a
    `finally:` after run(), which creates every model.

    A DDP model's C++ Reducer owns a reference to the group. Freed after
    destroy_process_group(), it destroys the gloo group while holding the GIL, and the gloo
    destructor joins a worker thread that needs the GIL: the rank hangs after its last line,
    or aborts at exit ("terminate called without an active exception"). Models die with
    run(); gc.collect() frees the ones kept alive by reference cycles. runbooks/exit-hang.md
    """
    failure = sys.exc_info()[1]  # in a `finally:` during an error: the error
    if failure is not None:
        # Its traceback keeps run()'s frames, and their models, alive: free them first.
        traceback.clear_frames(failure.__traceback__)
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(cfg, run):
    """For the labs that do not teach it (lab01 writes it out): init, run(cfg, rank,
    world_size, device, started), and teardown even after an error."""
    started = time.perf_counter()
    rank, world_size, device = init_distributed(cfg)
    try:
        run(cfg, rank, world_size, device, started)
    finally:
        teardown_distributed()


def init_mesh(device_type, mesh_shape, mesh_dim_names, timeout):
    """init_device_mesh, with init_process_group's timeout on every axis.

    In torch 2.13 init_device_mesh creates each axis smaller than the world with
    new_group(timeout=None), and that means the backend default (30 min on gloo, 10 on NCCL),
    not the timeout of the default group: a rank stuck in an FSDP, TP or pipeline collective
    would hold the job for that long. So each axis's groups are built here with the timeout,
    then wrapped in a DeviceMesh. Rank r sits at the position of r in
    arange(world).view(mesh_shape), as init_device_mesh would place it."""
    ranks = torch.arange(math.prod(mesh_shape)).view(mesh_shape)
    groups = []
    for dim, name in enumerate(mesh_dim_names):
        # One row per group along this axis: the ranks that differ only in coordinate `dim`.
        rows = ranks.movedim(dim, -1).reshape(-1, mesh_shape[dim]).tolist()
        group, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout,
                                                     group_desc=f"mesh_{name}")
        groups.append(group)
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=mesh_dim_names)
