"""Simulated multi-node Ray clusters for the controller tests (one process tree, loopback), and
the weights a job on one committed."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def simulated_cluster(nodes: int, cpus_per_node: int) -> Iterator:
    """A local multi-node Ray cluster (a head without CPUs and `nodes` worker nodes), connected
    to for the duration: yields (cluster, worker nodes). Workers run one thread each (several
    share 2 cores; raylets pass OMP_NUM_THREADS on)."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ["OMP_NUM_THREADS"] = "1"
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [c.add_node(num_cpus=cpus_per_node) for _ in range(nodes)]
    c.wait_for_nodes()
    ray.init(address=c.address)
    try:
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


def committed_weights(checkpoint_dir: str, step: int) -> dict:
    """The full model weights of committed checkpoint `step` under `checkpoint_dir` (any layout)."""
    import fsspec

    from longrun.checkpoint.catalog import load_model_weights
    from longrun.checkpoint.restore import read_manifest

    fs, root = fsspec.core.url_to_fs(checkpoint_dir)
    return load_model_weights(fs, root, step, read_manifest(fs, root, step))
