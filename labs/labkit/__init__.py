"""The lab kit: everything a lab uses but does not teach, written once.

Each lab in labs/ is its technique, top to bottom; it imports the rest from here. Copy a lab
together with this folder (torch and the standard library are all they need):

    cp labs/lab02_fsdp.py my_project/ && cp -r labs/labkit my_project/
    torchrun --nproc-per-node 2 my_project/lab02_fsdp.py --check-parity

One module per concern:
    errors      bad input: one line on stderr and exit status 2, before any process group
    flags       the flags every lab shares, model presets, and their validation
    runtime     device and precision, process-group init and teardown, the mesh with timeouts
    model       the Llama-style model, its initial values and its FLOPs per token
    data        synthetic sequences, token files, the resumable sampler, per-rank batches
    loop        learning-rate schedule, one training step, the loop and its log lines, preemption
    metrics     MFU, the metrics JSON and the final summary line
    checkpoint  atomic checkpoints (one file, or a DCP directory) and finding the newest
    plan        --plan: memory per rank against the GPU table, and refusing what cannot fit
    parity      --check-parity: the same training in one process, compared parameter by parameter
    probes      the bytes each rank holds, one step's collectives (--count-comms), the layout
    pipeline    what the pipeline labs share: schedule rules, the stage cut, the step, the clip
                across stages, per-stage precision, checkpoints of stage modules, the layout
    timeline    --timeline: when each pipeline action ran, the bubble, saved activation bytes
    faults      the fault drills (--fail-at-step, --stall-at-step, --crash-in-checkpoint)
"""
