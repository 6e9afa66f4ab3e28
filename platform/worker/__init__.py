"""The worker runtime: what runs inside each Ray actor, one per accelerator.

    actor.py   TrainWorker: warm, assume a rank, diagnose, run
    setup.py   the device, the communication groups (backend from the device), the trainer
    hooks.py   StepHooks: heartbeat, metrics, checkpoints and injected faults around each step
    preemption.py   a stop request: the step boundary every rank saves at, then stops
"""
