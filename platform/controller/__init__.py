"""The job driver: a state machine that places workers, watches them and recovers."""
