"""Whole log lines, as people paste them into the site's search box, with the runbook page that
explains each one (tests/test_site.py types every line into both editions' search).

Each line is a real message in the form a log shows it: rank and glog prefixes, timestamps,
pids, paths, ports and sizes included. Where it comes from:
- "drill": printed by the course's own drill or lab on torch 2.13, as the page quotes it;
- "reported": ../shared/reference/reported-errors.md, which names the public issues where users
  posted it (GPU-only and older-release texts, whose source line runbooks/errors.md names).
"""

PASTED_LOG_LINES = [  # (line, page under runbooks/, where it comes from)
    # Collectives and timeouts (gloo, CPU).
    ("[rank0]:[E1129 12:10:58.481120910 ProcessGroupGloo.cpp:67] [Rank 0]: Ranks 1 failed to "
     "pass monitoredBarrier in 3000 ms", "collective-timeout", "drill"),
    ("[rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
     "unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete",
     "collective-timeout", "drill"),
    ("[rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537]"
     " Read error [127.0.0.1]:25322: Connection reset by peer. This is typically caused by a "
     "remote worker hanging or bugs in the application. Check the logs of the remote worker "
     "before reporting an error. GLHF!", "collective-timeout", "drill"),
    ("terminate called after throwing an instance of 'gloo::EnforceNotMet'",
     "collective-timeout", "drill"),
    ("[rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
     " Connection closed by peer [127.0.0.1]:5020. This is typically caused by a remote worker "
     "crashing. Check the logs of the remote worker before reporting an error. GLHF!",
     "exit-hang", "drill"),
    ("[rank1]:[E1201 12:40:12.382410697 ProcessGroupGloo.cpp:67] Rank 1 successfully reached "
     "monitoredBarrier, but received errors while waiting for send/recv from rank 0. Please check "
     "rank 0 logs for faulty rank.", "rank0-busy", "drill"),
    ("[W1201 12:39:46.640111743 socket.cpp:494] [c10d] waitForInput: socket SocketImpl(fd=3, "
     "addr=[::ffff:127.0.0.1]:33796, remote=[::ffff:127.0.0.1]:44901) timed out after 3000ms",
     "rank0-busy", "drill"),
    ("[rank1]: torch.distributed.DistStoreError: wait timeout after 3000ms, keys: "
     "/default_pg/0//cpu//0/0", "rank0-busy", "drill"),
    # NCCL and its watchdog (GPU only).
    ("[rank1]:[E1201 10:02:11.123456789 ProcessGroupNCCL.cpp:632] [PG ID 0 PG GUID 0(default_pg) "
     "Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, "
     "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600013 milliseconds before timing out.",
     "nccl-watchdog-timeout", "reported"),
    ("[rank1]:[E1201 10:02:11.123987654 ProcessGroupNCCL.cpp:2170] [PG ID 0 PG GUID 0(default_pg) "
     "Rank 1] failure detected by watchdog at work sequence id: 5 PG status: last enqueued work: 5,"
     " last completed work: 4", "nccl-watchdog-timeout", "reported"),
    ("[rank1]:[E1201 10:02:11.124012345 ProcessGroupNCCL.cpp:668] Stack trace of the failed "
     "collective not found, potentially because FlightRecorder is disabled. You can enable it by "
     "setting TORCH_NCCL_TRACE_BUFFER_SIZE to a non-zero value.", "nccl-watchdog-timeout",
     "reported"),
    ("[rank3]:[E1201 10:02:11.123456789 ProcessGroupNCCL.cpp:1895] [PG ID 0 PG GUID 0(default_pg) "
     "Rank 3] To avoid data inconsistency, we are taking the entire process down.",
     "nccl-watchdog-timeout", "reported"),
    ("terminate called after throwing an instance of 'c10::DistBackendError'",
     "nccl-watchdog-timeout", "reported"),
    ("[rank0]:[W1201 12:40:02.000000000 Utils.hpp:110] terminate called after throwing an "
     "instance of 'c10::DistBackendError' what(): [PG ID 0 PG GUID 0(default_pg) Rank 0] Process "
     "group watchdog thread terminated with exception", "nccl-watchdog-timeout", "reported"),
    ("[rank0]: torch.distributed.DistBackendError: Work WorkNCCL(SeqNum=8, OpType=BROADCAST, "
     "NumelIn=262144, NumelOut=262144, Timeout(ms)=1800000) timed out in blocking wait.",
     "nccl-watchdog-timeout", "reported"),
    ("[rank2]:[E1201 11:20:07.555000000 ProcessGroupNCCL.cpp:1484] [PG ID 0 PG GUID 0(default_pg) "
     "Rank 2] Heartbeat monitor timed out! Process will be terminated after dumping debug info. "
     "workMetaList_.size()=2", "nccl-watchdog-timeout", "reported"),
    ("[rank2]:[F1201 11:28:07.555000000 ProcessGroupNCCL.cpp:1729] [PG ID 0 PG GUID 0(default_pg) "
     "Rank 2] [PG ID 0 PG GUID 0(default_pg) Rank 2] ProcessGroupNCCL's watchdog got stuck for "
     "480 seconds without making progress in monitoring enqueued collectives.",
     "nccl-watchdog-timeout", "reported"),
    ("[rank4]: torch.distributed.DistBackendError: [4] is setting up NCCL communicator and "
     "retrieving ncclUniqueId from [0] via c10d key-value store by key '0', but store->get('0') "
     "got error: Socket Timeout", "rank0-busy", "reported"),
    ("[rank0]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
     "ProcessGroupNCCL.cpp:1275, unhandled system error (run with NCCL_DEBUG=INFO for details), "
     "NCCL version 2.14.3", "nccl-errors", "reported"),
    ("[rank0]: ncclInternalError: Internal check failed. Last error: Socket recv failed",
     "nccl-errors", "reported"),
    ("[rank1]: ncclRemoteError: A call failed possibly due to a network error or a remote "
     "process exiting prematurely. Last error: socketProgressOpt: Call to recv from "
     "10.1.2.3<33759> failed : Connection reset by peer", "nccl-errors", "reported"),
    ("gpu-node-7:2342:2398 [3] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to "
     "10.1.2.4<51289> failed : Software caused connection abort", "nccl-errors", "reported"),
    ("gpu-node-7:2342:2412 [3] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from "
     "peer 10.1.2.4<42517> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid "
     "::ffff:10.1.2.3 remoteGids::ffff:10.1.2.4 hca mlx5_0", "nccl-errors", "reported"),
    ("[rank1]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
     "NCCLUtils.hpp:275, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.20.5"
     " ncclInvalidUsage: This usually reflects invalid usage of NCCL library. Last error: "
     "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 10", "nccl-errors",
     "reported"),
    # torchrun and elastic.
    ("[rank0]:[W1201 12:42:33.099641772 socket.cpp:561] torch.distributed.DistNetworkError: The "
     "server socket has failed to listen on any local network address. port: 29500, useIpv6: "
     "false, code: -98, name: EADDRINUSE, message: address already in use", "address-in-use",
     "drill"),
    ("[W1201 12:42:33.089463416 socket.cpp:525] [c10d] The server socket has failed to bind to "
     "[::]:39123 (errno: 98 - Address already in use).", "address-in-use", "drill"),
    ("RuntimeError: The server socket has failed to listen on any local network address. "
     "useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use",
     "address-in-use", "reported"),
    ("E1201 12:39:48.512000 11750 torch/distributed/elastic/multiprocessing/api.py:1003] failed "
     "(exitcode: 1) local_rank: 1 (pid: 11757) of binary: /usr/bin/python3",
     "torchrun-child-failed", "drill"),
    ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
     "torchrun-child-failed", "drill"),
    ("  error_file: <N/A>", "torchrun-child-failed", "reported"),
    ("  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
     "torchrun-child-failed", "drill"),
    ("[node 0] torch.distributed.elastic.rendezvous.api.RendezvousClosedError",
     "rendezvous-closed", "drill"),
    ("[rank0]: torch.distributed.DistStoreError: Timed out after 6 seconds waiting for clients. "
     "1/2 clients joined.", "startup-hang", "drill"),
    ("[W1129 12:21:32.118557574 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate "
     "to host 127.0.0.1:58081 - retrying (try=0, timeout=4000ms, delay=5295ms): The client socket "
     "has timed out after 4000ms while trying to connect to (127.0.0.1, 58081).",
     "startup-hang", "drill"),
    ("torch.distributed.DistNetworkError: The client socket has timed out after 4000ms while "
     "trying to connect to (127.0.0.1, 58081).", "startup-hang", "drill"),
    ("RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/"
     "pair.h:311] Connect timeout [none]", "restart-hang", "drill"),
    # DataLoader.
    ("[rank0]: RuntimeError: Caught RuntimeError in DataLoader worker process 0. stack expects "
     "each tensor to be equal size, but got [3] at entry 0 and [5] at entry 1",
     "dataloader-worker-error", "drill"),
    ("KeyError: Caught KeyError in DataLoader worker process 1.", "dataloader-worker-error",
     "drill"),
    ("RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
     "multiprocessing, you must use the 'spawn' start method", "dataloader-worker-error",
     "reported"),
    ("[rank1]: RuntimeError: Too many open files. Communication with the workers is no longer "
     "possible. Please increase the limit using `ulimit -n` in the shell or change the sharing "
     "strategy by calling `torch.multiprocessing.set_sharing_strategy('file_system')` at the "
     "beginning of your code", "dataloader-shared-memory", "drill"),
    ("RuntimeError: unable to open shared memory object </torch_20654_3530902486_58> in "
     "read-write mode: Too many open files (24)", "dataloader-shared-memory", "drill"),
    ("[rank2]: RuntimeError: unable to allocate shared memory(shm) for file "
     "</torch_20690_3638420739_1>: No space left on device (28)", "dataloader-shared-memory",
     "drill"),
    ("RuntimeError: unable to write to file </torch_18692_1954506624>: No space left on device "
     "(28)", "dataloader-shared-memory", "reported"),
    ("[rank0]: RuntimeError: DataLoader worker (pid 22934) is killed by signal: Killed.",
     "dataloader-worker-killed", "drill"),
    ("RuntimeError: DataLoader worker (pid 22956) is killed by signal: Bus error. It is possible "
     "that dataloader's workers are out of shared memory. Please try to raise your shared memory "
     "limit.", "dataloader-worker-killed", "drill"),
    ("ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient "
     "shared memory (shm).", "dataloader-worker-killed", "drill"),
    ("RuntimeError: DataLoader worker (pid(s) 22994) exited unexpectedly",
     "dataloader-worker-killed", "drill"),
    ("[rank1]: RuntimeError: DataLoader timed out after 2.0 seconds", "dataloader-worker-hangs",
     "drill"),
    # DDP and memory.
    ("[rank0]: RuntimeError: Expected to have finished reduction in the prior iteration before "
     "starting a new one. This error indicates that your module has parameters that were not "
     "used in producing loss.", "ddp-unused-parameters", "drill"),
    ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has "
     "a total capacity of 39.38 GiB of which 3.76 GiB is free. Including non-PyTorch memory, "
     "this process has 0 bytes memory in use.", "oom-reading-the-error", "reported"),
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
     "total capacty of 79.15 GiB of which 1.06 GiB is free. Process 1943 has 78.08 GiB memory in "
     "use.", "oom-reading-the-error", "reported"),
]
