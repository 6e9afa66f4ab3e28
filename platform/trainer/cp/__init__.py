"""Context parallelism: one sequence's tokens spread over a group of ranks.

    layout.py       how a micro-batch's documents split over a CP group (zigzag per document)
    attention.py    CP attention for one micro-batch: ring, Ulysses or USP over commgroup's groups
    flash.py        the flash block kernel (default): varlen flash on CUDA, flash SDPA on CPU,
                    documents as runs and segments, no score block; the kernel choice
    kernel.py       the float32 math block kernel (masks, LSE): the fallback and the baseline
    ring.py         ring attention: K/V blocks around the group, transfers under compute
    ulysses.py      Ulysses all-to-all between "my tokens, all heads" and "all tokens, my heads"
    cost.py         the cost model of a planned micro-batch (compute, ring transfers, overheads)
    plan.py         what a plan is: per micro-batch, CP groups with their sequences
    planner.py      dynamic CP: per-step plans of power-of-two groups; static CP as the baseline
    greedy.py       the dynamic planner's greedy pass (buddy-allocated ranks, heaps of groups)
    batches.py      a global batch -> this rank's planned micro-batches; the CP setup from
                    commgroup's groups (this package creates no process group)
    calibration.py  the cost model measured through the trainer's own path, cached per job
"""
