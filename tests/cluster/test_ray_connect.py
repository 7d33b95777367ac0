"""Which Ray cluster a driver joins: with no address, a fresh local instance, even where
a crashed one left its address file behind (Ray would try to join that one)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = """
import ray
from lamina.cluster.connect import connect_ray
print("RESULT", connect_ray())
print("NODES", len(ray.nodes()))
ray.shutdown()
"""


def test_no_address_starts_a_fresh_local_instance_despite_a_stale_address_file():
    tmp = tempfile.mkdtemp(prefix="lr", dir="/tmp")  # short: Ray's socket paths live here
    try:
        (Path(tmp) / "ray").mkdir()
        # what a crashed instance leaves: the address of a GCS that is gone
        (Path(tmp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_TMPDIR=tmp, RAY_AUTH_MODE="disabled")
        # the trap: Ray's implicit join of the stale address refuses a local start
        old = subprocess.run([sys.executable, "-c", "import ray; ray.init(num_cpus=2)"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert old.returncode != 0 and "existing cluster" in old.stderr, old.stderr[-500:]
        r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                           text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "RESULT started a local Ray instance" in r.stdout, r.stdout
        assert "set RAY_ADDRESS to join a cluster" in r.stdout and "NODES 1" in r.stdout
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
