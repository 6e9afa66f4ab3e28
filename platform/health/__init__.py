"""Knowing something is wrong, and what: heartbeats, monitors, diagnostics, policy, faults."""
