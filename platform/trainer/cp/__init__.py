"""Context parallelism: one sequence's tokens spread over a group of ranks.

    layout.py       how a micro-batch's documents split over a CP group (zigzag per document)
    attention.py    ring attention (overlapped P2P), Ulysses all-to-all, USP; the block kernel
    cost.py         the cost model of a planned micro-batch (compute, ring transfers, overheads)
    planner.py      dynamic CP: per-step plans of power-of-two groups; static CP as the baseline
    batches.py      a global batch -> this rank's planned micro-batches; CP setups from groups
    calibration.py  the cost model measured through the trainer's own path, cached per job
"""
