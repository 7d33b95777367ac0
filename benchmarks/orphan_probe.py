"""How long does a request run once the client reading it has died?

    python benchmarks/orphan_probe.py [LEASE_S]     # default 30 (cluster.client_lease_s)

A local Ray instance, a Lamina service of one memory worker, and an HTTP front over it
in a subprocess (`lamina serve --service`). A streamed completion of 3000 tokens
(`ignore_eos`) is sent through the front; after its first events the front is killed
(SIGKILL), and the service's status is printed every second until nothing runs or 70 s
pass. Before client leases the request ran on (still running 39 s after the kill);
with them it is aborted once the front's lease runs out. Stops the service after.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import ray

from lamina.cluster.client import connect
from lamina.cluster.service import down, up
from lamina.engine.config import EngineConfig
from lamina.entrypoints.deploy_config import ClusterConfig, LaminaConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_front(port: int) -> subprocess.Popen:
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    front = subprocess.Popen([sys.executable, "-m", "lamina.entrypoints.cli", "serve",
                              "--service", "lamina", "--port", str(port)], env=env)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return front
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError("the front did not listen within 120 s") from None
            time.sleep(0.5)


def main() -> None:
    lease = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    ray.init(num_cpus=4)
    up(LaminaConfig(engine=EngineConfig(num_memory_workers=1, num_kv_slots=8192),
                    cluster=ClusterConfig(executor="ray", max_restarts=0,
                                          client_lease_s=lease)))
    try:
        client, port = connect(), free_port()
        front = start_front(port)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True,
            "stream": True, "temperature": 0}), {"Content-Type": "application/json"})
        answer = conn.getresponse()
        for _ in range(5):
            answer.readline()
        os.kill(front.pid, signal.SIGKILL)
        front.wait()
        killed = time.monotonic()
        for _ in range(70):
            s = client.status()
            print(f"{time.monotonic() - killed:5.1f} s after the front's kill: running "
                  f"{s['running']}, aborted {s['aborted']}", flush=True)
            if not s["running"]:
                break
            time.sleep(1)
    finally:
        down()


if __name__ == "__main__":
    main()
