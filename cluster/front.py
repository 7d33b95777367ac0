"""The deployment's own HTTP front: with `cluster.http_port` set, `lamina up` starts the
OpenAI server over the service (what `lamina serve --service` runs) as an actor of the
deployment, so the endpoint comes up with it, outlives the shell that started it, and
comes back when its process dies.

Data in: the service's name, the address to serve on (`cluster.http_host`,
`cluster.http_port`; 0: a free port) and the deployment's `ServerConfig`. Data out: the
front's URL (`start_front`), kept in Ray's key-value store beside the service's record
(`service.front_of`), so `lamina status` shows where to send HTTP clients; `stop_front`
ends it.

The front is a detached actor named `<service>:http` in the services' namespace, pinned
to the node `lamina up` ran on (the head, on a `ray up` cluster: the address users
know), taking no CPU (its event loop waits on the service; the workers hold the cores).
Ray restarts its process whenever it dies, on the same port; the service's own
restarts leave it up (its `/health` answers 503 "restarting" meanwhile, as a `lamina
serve --service` front's does). More fronts, on other nodes, are `lamina serve
--service` processes: every front of one deployment shares its queue and its stored
Responses.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lamina.entrypoints.api_server import ServerConfig, listen
from lamina.entrypoints.deploy_config import ClusterConfig

from .service import NAMESPACE, ServiceError, find, forget_front, front_of, note_front

log = logging.getLogger(__name__)

STARTED_WITHIN_S = 30.0  # uvicorn serving once the service answered


def front_name(service: str) -> str:
    return f"{service}:http"


@ray.remote(num_cpus=0)
class HttpFront:
    """`lamina serve --service NAME` in an actor: uvicorn on a thread of its own over a
    `ServiceLoop`, on a socket bound first (a port in use fails the constructor, by
    name, before anything waits on the service)."""

    def __init__(self, service: str, host: str, port: int, config: ServerConfig):
        import uvicorn

        from lamina.entrypoints.api_server import build_app

        from .client import Client, ServiceLoop

        self.sock = listen(host, port)
        client = Client(find(service), service)  # waits for a service that restarts
        app = build_app(ServiceLoop(client), client.model(), client.tokenizer(), config)
        bound = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=bound, log_level="warning",
            timeout_graceful_shutdown=config.shutdown_timeout_s))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="lamina-http")
        self.thread.start()
        deadline = time.monotonic() + STARTED_WITHIN_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP front could not serve on {host}:{bound} (its "
                                   "error is in its log: `ray logs actor`)")
            time.sleep(0.02)
        shown = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "") else host
        self.record = {"url": f"http://{shown}:{bound}", "pid": os.getpid(),
                       "node": ray.get_runtime_context().get_node_id(), "since": time.time()}
        note_front(service, self.record)
        log.info("the HTTP front of the Lamina service %r serves on %s", service,
                 self.record["url"])
        threading.Thread(target=self._exit_with_the_server, daemon=True,
                         name="lamina-http-watch").start()

    def _exit_with_the_server(self) -> None:
        """uvicorn on a thread ends only by a crash (nothing here asks it to stop; `ray
        kill` ends the process): the process exits with it, so Ray starts a front that
        serves, rather than keeping an actor that answers `ready` over a closed port."""
        self.thread.join()
        log.error("the HTTP front's server ended; its process exits for Ray to restart it")
        os._exit(1)

    def ready(self) -> dict:
        return self.record


def front_state(service: str, timeout_s: float = 2.0) -> dict | None:
    """The service's front record (`service.front_of`) with its "state" now: "serving"
    (its process answered within `timeout_s`), "restarting" (it did not: Ray is starting
    its process again, whose constructor waits for the service), or "gone" (no actor
    by its name, e.g. removed by hand). None when the service has no front."""
    record = front_of(service)
    if record is None:
        return None
    try:
        front = ray.get_actor(front_name(service), namespace=NAMESPACE)
    except ValueError:
        return {**record, "state": "gone"}
    try:
        return {**ray.get(front.ready.remote(), timeout=timeout_s), "state": "serving"}
    except Exception:  # noqa: BLE001 - a timeout, or its process died meanwhile
        return {**record, "state": "restarting"}


def check_port(cluster: ClusterConfig) -> None:
    """A front's port in use on this node (where `start_front` places it) fails here, at
    once, not after the service's model and workers are up."""
    if cluster.http_port not in (None, 0):
        listen(cluster.http_host, cluster.http_port).close()


def start_front(service: str, cluster: ClusterConfig, server: ServerConfig,
                timeout_s: float) -> dict:
    """The front of the running service `service` on this node -> its record (its
    "url"); ServiceError saying why when it cannot serve (the actor then removed)."""
    node = ray.get_runtime_context().get_node_id()
    front = HttpFront.options(
        name=front_name(service), namespace=NAMESPACE, lifetime="detached",
        max_restarts=-1, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(service, cluster.http_host, cluster.http_port, server)
    try:
        return ray.get(front.ready.remote(), timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - whatever stopped it: remove it, say why
        ray.kill(front, no_restart=True)
        cause = getattr(e, "cause", None) or e
        raise ServiceError(f"the HTTP front of the Lamina service {service!r} failed to "
                           f"start: {type(cause).__name__}: {cause}") from None


def stop_front(service: str, timeout_s: float = 30.0) -> None:
    """The service's front ended (none: nothing), its port free (Ray frees the name once
    the process is gone) and its record removed."""
    deadline = time.monotonic() + timeout_s
    try:
        ray.kill(ray.get_actor(front_name(service), namespace=NAMESPACE), no_restart=True)
        while time.monotonic() < deadline:
            ray.get_actor(front_name(service), namespace=NAMESPACE)
            time.sleep(0.1)
        log.warning("the HTTP front of %r was killed but is still named after %g s",
                    service, timeout_s)
    except ValueError:  # none, or gone
        pass
    forget_front(service)
