"""Never losing work, never blocking long: two-stage asynchronous checkpoints."""
