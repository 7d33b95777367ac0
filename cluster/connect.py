"""Joining the Ray cluster: the one step every driver, `lamina` command and service
takes first.

Data in: an address (or $RAY_ADDRESS, or none). Data out: this process connected to
that cluster, or to a fresh local instance; what happened, as logged. Kept apart from
the executor (which imports torch through the data plane) so that the cluster commands
(`lamina status`, `scale`, `down`) and `lamina.connect()` start in about two seconds.
"""
from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger(__name__)


def connect_ray(address: str | None = None) -> str:
    """Join the Ray cluster at `address` (or $RAY_ADDRESS; "auto": the one this node
    belongs to), or with neither start a fresh local instance. Never Ray's implicit
    reuse of the last cluster started here: a crashed one leaves its address behind and
    a new driver would fail to join it with a message that says nothing of that.
    -> what happened, as logged."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        what = f"joined the Ray cluster at {address} ({ray.get_runtime_context().gcs_address})"
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 num_cpus=max(2, os.cpu_count() or 2))
        what = (f"started a local Ray instance ({ray.get_runtime_context().gcs_address}); "
                "set RAY_ADDRESS to join a cluster")
    log.info("%s", what)
    return what
