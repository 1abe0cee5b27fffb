"""A real Ray cluster on this machine for tests: a head and worker nodes, each a raylet with its
own CPUs and custom resources (``ray.cluster_utils.Cluster``), connected the way ``--ray``
connects (``experiments.ray_session.connect``). Small on purpose: Ray on a shared 2-core machine is
slow to start, so each test module starts one and reuses it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def ray_cluster(head: dict[str, Any], *workers: dict[str, Any]) -> Iterator[Any]:
    """A running cluster (``head``: the head node's options; ``workers``: one mapping of
    options per further node), this process connected to it; shut down at the end."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install reflexsim[ray]")
    import ray
    from ray.cluster_utils import Cluster

    from experiments.ray_session import connect

    cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, **head})
    try:
        for options in workers:
            cluster.add_node(**options)
        cluster.wait_for_nodes()
        connect(cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
