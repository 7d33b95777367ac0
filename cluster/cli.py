"""The cluster commands of `lamina`: `up`, `status`, `scale`, `down`, `batch`, and
`serve --service`.

Data in: the command's flags (and a `LaminaConfig` YAML for `up`). Data out: the
service started or stopped, its status printed, a batch's OUTPUT file. `lamina`'s
parser finds this module by name (`lamina.entrypoints.cli`), and ray is imported only
inside the commands, so `lamina --help` stays fast.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import replace

SERVICE = "lamina"  # = service.SERVICE (not imported here: that would import ray)


def add_parsers(sub) -> None:
    u = sub.add_parser("up", help="start the Lamina service on the running Ray cluster")
    u.add_argument("--config", default=None, help="a LaminaConfig YAML file")
    u.add_argument("--timeout", type=float, default=600,
                   help="seconds to wait for the model and workers to come up")
    u.add_argument("--http-port", type=int, default=None,
                   help="serve the OpenAI API on this port of this node, as part of the "
                        "deployment (cluster.http_port; 0: a free port)")
    u.add_argument("--http-host", default=None,
                   help="the address that front listens on (cluster.http_host; default "
                        "0.0.0.0)")
    u.add_argument("--api-key", default=None,
                   help="that front requires 'Authorization: Bearer KEY' on /v1/* (or "
                        "LAMINA_API_KEY; kept out of config files)")
    _where(u)
    u.set_defaults(fn=cmd_up)
    s = sub.add_parser("status", help="the Lamina service: workers, nodes, KV use, queue")
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    s.add_argument("--wait", action="store_true",
                   help="while the service restarts, wait for it to answer (else say so "
                        "at once)")
    _where(s)
    s.set_defaults(fn=cmd_status)
    c = sub.add_parser("scale", help="grow or shrink the service's KV pool (its memory "
                       "workers) while it serves")
    c.add_argument("--memory-workers", type=int, required=True,
                   help="how many memory workers from now on (fewer: the sequences with "
                        "KV on a leaving one are preempted and computed again)")
    _where(c)
    c.set_defaults(fn=cmd_scale)
    d = sub.add_parser("down", help="stop the Lamina service and release its resources")
    _where(d)
    d.set_defaults(fn=cmd_down)
    b = sub.add_parser("batch", help="run an OpenAI batch file (JSONL) through the service "
                       "(or, with none running, a local engine); resumable")
    b.add_argument("input", help="requests: one {custom_id, method, url, body} per line")
    b.add_argument("output", help="answers, one per line; lines already here are skipped")
    b.add_argument("--local", action="store_true",
                   help="use a local engine even where a service runs")
    b.add_argument("--config", default=None,
                   help="a LaminaConfig YAML for the local engine")
    b.add_argument("--no-progress", action="store_true")
    _where(b)
    b.set_defaults(fn=cmd_batch)


def _where(p) -> None:
    p.add_argument("--name", default=SERVICE, help="the service's name (default: lamina)")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: $RAY_ADDRESS, else this node's)")


@contextlib.contextmanager
def _said():
    """The cluster's errors as `lamina: error: ...` (exit 2), not tracebacks."""
    from .placement import PlacementTimeout
    from .service import ServiceError, ServiceNotFound

    try:
        yield
    except (ServiceError, ServiceNotFound, PlacementTimeout) as e:
        raise ValueError(str(e)) from None
    except ConnectionError as e:
        raise ValueError(f"no Ray cluster to join ({e}); start one with `ray up` "
                         "or `ray start --head`") from None


def cmd_up(args) -> int:
    from lamina.entrypoints.deploy_config import LaminaConfig

    from .service import up

    config = LaminaConfig.from_yaml(args.config) if args.config else LaminaConfig()
    http = {k: v for k, v in (("http_port", args.http_port), ("http_host", args.http_host))
            if v is not None}
    key = args.api_key or os.environ.get("LAMINA_API_KEY") or None
    config = replace(config, cluster=replace(config.cluster, **http),
                     server=replace(config.server, api_key=key or config.server.api_key))
    c = config.cluster
    if c.http_port is not None and config.server.api_key is None and \
            c.http_host not in ("127.0.0.1", "localhost", "::1"):
        print(f"note: the HTTP front on {c.http_host}:{c.http_port} answers anyone who "
              "reaches it (no API key: --api-key, $LAMINA_API_KEY or server.api_key)",
              file=sys.stderr)
    with _said():  # the config was checked above, before any actor starts
        up(config, args.name, args.address or "auto", args.timeout)
    print(f"Lamina service {args.name!r} is up", flush=True)
    return _print_status(_client(args).status(), False)


def cmd_status(args) -> int:
    from .front import front_state

    s = _client(args).status(wait=args.wait)
    if "http" in s:  # the record, and whether its process serves right now
        s["http"] = front_state(s["name"])
    return _print_status(s, args.json)


def cmd_scale(args) -> int:
    client = _client(args)
    with _said():
        done = client.scale_memory_workers(args.memory_workers)
    print(f"service {args.name!r}: memory workers {done['before']} -> {done['after']} in "
          f"{done['seconds']:.1f} s; {done['relocated']} running sequences moved with "
          f"their KV ({done['relocated_tokens']} positions), {done['preempted']} preempted, "
          f"{done['recompute_tokens']} positions to compute again, "
          f"{done['moved_tokens']} saved positions moved to the workers kept")
    return 0


def _waiting_line(w: dict) -> str:
    """`lamina status`'s line for a sequence waiting for the pools to grow."""
    return (f"  waiting for memory workers: sequence {w['seq_id']} needs {w['tokens']} KV "
            f"positions, the pools of {w['workers']}; waited {w['waited_s']:.0f} s of at "
            f"most {w['wait_s']:g}")


def cmd_down(args) -> int:
    from .service import down

    _client(args)  # joins the cluster; names a missing service
    with _said():
        down(args.name)
    print(f"Lamina service {args.name!r} stopped; its workers and placement group are "
          "released")
    return 0


def _client(args):
    from .client import connect

    with _said():
        return connect(args.address, args.name)


def _recoveries_line(s: dict) -> str:
    """`lamina status`'s line of the service's recoveries (`LaminaService.status`)."""
    replaced = ", ".join(f"{n} {role}" for role, n in s["workers_replaced"].items())
    lost = s.get("memory_workers_lost", 0)
    return (f"  recoveries: {s['recoveries']} failed steps recovered, the KV of "
            f"{s['kv_kept_tokens']} positions kept through them; workers replaced: "
            f"{replaced}" + (f"; memory workers lost (dead, no replacement could start): "
                             f"{lost}, the engine went on without them" if lost else ""))


def _print_status(s: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps(s, indent=2))
        return 0
    if "workers" not in s:  # Ray is starting its process again (`restarting_status`)
        print(f"service {s['name']!r}: RESTARTING: {s['error']}; `lamina status --wait` "
              "waits for it")
        return 0
    state = {"running": "running", "restarting": f"RESTARTING: {s['error']}"}.get(
        s["state"], f"STOPPED: {s['error']}")
    print(f"service {s['name']!r}: {state}, model {s['model']}, up {s['uptime_s']:.0f} s")
    for w in s["workers"]:
        print(f"  {w['role']:<10} node {w['node'][:12]}  {w['threads']} threads  "
              f"{w['transport']}")
    for k in s["kv"]:
        used = k["total"] - k["free"]
        print(f"  KV of memory worker {k['worker']}: {used}/{k['total']} slots used by "
              f"requests, {k['cached']} cached prefix tokens")
    print(f"  queue: {s['waiting']} waiting, {s['running']} running; finished "
          f"{s['finished']}, aborted {s['aborted']}, failed {s['failed']}, "
          f"rejected {s['rejected']}; clients {s['clients']} (requests of silent ones "
          f"aborted: {s['orphans_aborted']})")
    print(_recoveries_line(s))
    size = s.get("size")
    if size is not None and size["short_why"] is not None:
        failed = size.get("regrow_failed")
        print(f"  memory workers: {size['live']} of its {size['memory_workers']} "
              f"(short: {size['short_why']}); {size['regrow']}"
              + (f" (its last try failed: {failed})" if failed else ""))
    limit = "always" if s["max_restarts"] == -1 else f"at most {s['max_restarts']}"
    last = f"; the latest because {s['restart_cause']}" if s["restarts"] else ""
    print(f"  restarts: {s['restarts']} ({limit}){last}")
    print(f"  HTTP: {_front(s['http'], s['name'])}")
    a = s.get("autoscale")
    if a is not None:
        last = a["last"]
        print(f"  autoscale: {a['min']}-{a['max']} memory workers, {a['changes']} changes"
              + ("" if last is None else f"; the last {last['before']} -> {last['after']} "
                 f"{last['ago_s']:.0f} s ago: {last['why']}")
              + ("" if a["error"] is None else f"; last failure: {a['error']}"))
    if s.get("waiting_for_workers") is not None:
        print(_waiting_line(s["waiting_for_workers"]))
    print(f"  stored responses: {s['stored_responses']}, {_size(s['stored_response_bytes'])} "
          f"(at most {s['max_stored_responses']} and {_size(s['max_stored_response_bytes'])},"
          f" kept through restarts)")
    return 0


def _front(front: dict | None, name: str) -> str:
    if front is None:
        return f"no front of its own (`lamina serve --service {name}` serves it)"
    state = {"serving": f"its front's pid {front['pid']}",
             "restarting": "RESTARTING: its front's process died; Ray starts it again",
             "gone": "GONE: its front's actor was removed; `lamina down`, then `up`"}
    return f"{front['url']} ({state[front.get('state', 'serving')]})"


def _size(n: int) -> str:
    """Bytes in words: 900 B, 4.2 KiB, 256.0 MiB."""
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def cmd_batch(args) -> int:
    from lamina.entrypoints.batch import BatchRetry, read_input, run_batch
    from lamina.entrypoints.engine_loop import beside

    read_input(args.input)  # a malformed file is refused before any engine starts
    app, stop, here = _batch_app(args)
    # a 503 from a service: it restarts, so the line is sent again; a local engine's
    # 503 means it stopped for good
    retry = BatchRetry(unavailable=here is None)
    try:
        def answer():
            return run_batch(app, args.input, args.output, progress=not args.no_progress,
                             retry=retry)

        # a local engine runs on this thread, the one that built it (EngineLoop.run)
        r = beside(here, answer) if here is not None else answer()
    finally:
        stop()
    print(f"{args.output}: {r.done} answered now ({r.failed} with an error status, "
          f"{r.retried} sent again after a 429 / 503), {r.skipped} already there, "
          f"{r.total} in {args.input}", file=sys.stderr)
    if r.left:
        print(f"{r.left} lines left unanswered (the last answer: {r.why_left}); run the "
              "same command again to answer them", file=sys.stderr)
        return 1
    return 0


def _batch_app(args):
    """The server app over the running service, else over a local engine -> (app, stop,
    the local engine's loop, for this thread to run, or None)."""
    from lamina.entrypoints.api_server import build_app

    client = None if args.local else _service_if_any(args)
    if client is not None:
        from .client import ServiceLoop

        loop = ServiceLoop(client)
        print(f"batch through the Lamina service {args.name!r}", file=sys.stderr)
        return build_app(loop, client.model(), client.tokenizer()), loop.shutdown, None
    from lamina.entrypoints.deploy_config import LaminaConfig
    from lamina.entrypoints.engine_loop import EngineLoop
    from lamina.entrypoints.llm import LLM

    llm = LLM.from_config(LaminaConfig.from_yaml(args.config) if args.config
                          else LaminaConfig())
    loop = EngineLoop(llm.engine, thread=False)
    print("batch on a local engine (no Lamina service runs)", file=sys.stderr)

    def stop():
        loop.shutdown()
        llm.shutdown()
    return build_app(loop, llm.loaded.source, llm.loaded.tokenizer), stop, loop


def _service_if_any(args):
    """A client of the service, or None where no cluster or no service runs."""
    import os

    from .client import connect
    from .service import ServiceNotFound

    address = args.address or os.environ.get("RAY_ADDRESS") or _this_nodes_cluster()
    if address is None:
        return None
    try:
        return connect(address, args.name)
    except (ServiceNotFound, ConnectionError):
        return None


def _this_nodes_cluster() -> str | None:
    """The address of the Ray cluster this node belongs to, if its GCS answers (a crashed
    instance leaves its address file behind: that one is not joined)."""
    import socket

    from ray._private.services import canonicalize_bootstrap_address

    try:
        address = canonicalize_bootstrap_address("auto")
    except (ConnectionError, ValueError):
        return None
    if address is None:
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return None
    return address


def serve_service(args, config) -> int:
    """`lamina serve --service NAME`: the HTTP server over a running service."""
    from lamina.entrypoints.api_server import listen, serve_loop

    from .client import ServiceLoop

    sock = listen(args.host, args.port)  # a port in use fails before joining the cluster
    try:
        client = _client(args)
        model = client.model()
    except BaseException:
        sock.close()
        raise
    print(f"serving the Lamina service {args.name!r} ({model}) on "
          f"http://{args.host}:{sock.getsockname()[1]}", flush=True)
    serve_loop(ServiceLoop(client), args.served_model_name or model, client.tokenizer(),
               args.host, args.port, config, sock)
    return 0
