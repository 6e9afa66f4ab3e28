"""Helpers for tests and benchmarks of longrun (like `torch.testing`): spawned worlds of ranks."""
