"""Goodput: where every second of a job's wall time went, from a per-step ledger.

    ledger.py       the workers' step ledger in Redis (StepLedger) and the controller's reader
    accounting.py   pure: controller states + ledger records -> seconds per bucket, faults, steps lost
    tracker.py      the controller's side: reads the ledger, keeps the account, persists the summary
    summary.py      the job-wide summary in Redis and its one-line description

Torch-free: the controller and `longrun status` import it.
"""
