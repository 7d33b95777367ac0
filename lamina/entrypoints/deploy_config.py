"""`LaminaConfig`: one deployment's settings, one frozen section per concern, from YAML.

Data in: a YAML file (or a dict) with the sections `model`, `engine`, `cluster`,
`server` and `autoscale`, every one optional:

    model:   {path: null, dtype: bfloat16}         # null: the embedded SmolLM2
    engine:  {num_memory_workers: 2, num_kv_slots: 16384, max_batch: 64}
    cluster: {executor: ray, address: auto, max_restarts: -1}
    server:  {max_waiting: 1024}
    autoscale: {min_memory_workers: 1, max_memory_workers: 8}   # a server's KV pool

Data out: a validated `LaminaConfig` (`ModelConfig`, `EngineConfig`, `ClusterConfig`,
`ServerConfig`, `AutoscaleConfig`). An unknown section or key, a value of the wrong
type, a bad value and a model path that does not exist are refused with a `ValueError`
naming the key, before anything starts. `LLM.from_config` and `lamina generate|serve
--config FILE` read it; the `autoscale` section the servers (`lamina up`, `lamina serve
--config`).
"""
from __future__ import annotations

import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from lamina.engine.config import EngineConfig
from lamina.entrypoints.api_server import ServerConfig
from lamina.entrypoints.autoscale import AutoscaleConfig, check_seconds

DTYPES = ("float32", "bfloat16")
EXECUTORS = ("local", "ray")
NOT_IN_FILES = {"faults"}  # EngineConfig's test hook is not a deployment setting


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # HF folder or .gguf file; None: the embedded SmolLM2
    dtype: str = "float32"  # weights and KV pools: float32 | bfloat16

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.path is not None and not Path(os.path.expanduser(self.path)).exists():
            raise ValueError(f"model.path {self.path!r} does not exist")


@dataclass(frozen=True)
class ClusterConfig:
    executor: str = "local"  # "local": one process; "ray": Ray workers
    address: str | None = None  # Ray cluster ("auto", "host:port"); None: $RAY_ADDRESS or new
    # A Lamina service (`lamina up`) whose process dies or whose engine stops starts
    # again, with new workers, up to this many times in its life; -1: always, 0: never.
    # Only the service reads it: a driver's own engine (`LLM`) has no supervisor.
    max_restarts: int = -1
    # The service's own HTTP front (OpenAI API, cluster/front.py): `lamina up` starts it
    # on its node, on this port (0: a free one; `lamina status` shows the URL), and Ray
    # restarts it when its process dies. None: none (`lamina serve --service` serves
    # the service from anywhere, as many as you like).
    http_port: int | None = None
    http_host: str = "0.0.0.0"
    # A client of the service (a driver, a Ray job, an HTTP front) renews a lease every
    # third of this while it lives; one silent for longer (its process died) has its
    # requests aborted, so nobody's requests hold the batch and the KV to their end.
    client_lease_s: float = 30.0
    # A Ray deployment (the service, `lamina serve`'s or an `LLM`'s) keeps its memory
    # workers' count (`engine.num_memory_workers`, or what `lamina scale` set): after
    # a service's restart that found room for fewer, or workers lost for good at a
    # recovery, it tries to grow back every this many seconds once the cluster's
    # resources hold more (`KeepSize`; a failed try waits twice as long before the
    # next, up to 5 min). 0: never (`lamina scale` does it). Off with an autoscaler,
    # which sets the count itself.
    regrow_interval_s: float = 10.0
    # A service's restart that finds no room for even `engine.min_live_memory_workers`
    # (its compute node gone, say, until `ray up`'s autoscaler brings another) waits
    # this long for room, looking every 5 s, then fails, naming what is missing. 0:
    # fails at once.
    room_wait_s: float = 600.0

    def __post_init__(self):
        if self.executor not in EXECUTORS:
            raise ValueError(f"cluster.executor must be one of {EXECUTORS}, "
                             f"got {self.executor!r}")
        if self.address is not None and self.executor != "ray":
            raise ValueError("cluster.address is for executor 'ray'")
        if (not isinstance(self.max_restarts, int) or isinstance(self.max_restarts, bool)
                or self.max_restarts < -1):
            raise ValueError("cluster.max_restarts must be an int >= -1 (-1: always), "
                             f"got {self.max_restarts!r}")
        port = self.http_port
        if port is not None and (not isinstance(port, int) or isinstance(port, bool)
                                 or not 0 <= port <= 65535):
            raise ValueError(f"cluster.http_port must be a port (0-65535; 0: a free one) "
                             f"or null, got {port!r}")
        lease = self.client_lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not 0 < lease \
                < float("inf"):
            raise ValueError(f"cluster.client_lease_s must be a number of seconds > 0, "
                             f"got {lease!r}")
        check_seconds("cluster.regrow_interval_s", self.regrow_interval_s, " (0: never)")
        check_seconds("cluster.room_wait_s", self.room_wait_s)
        if not isinstance(self.http_host, str) or not self.http_host:
            raise ValueError(f"cluster.http_host must be an address to serve on, got "
                             f"{self.http_host!r}")


@dataclass(frozen=True)
class LaminaConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    # a server's KV pool autoscaling (`lamina up`, `lamina serve --config`;
    # lamina/entrypoints/autoscale.py)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> LaminaConfig:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"config {path}: {e}") from None
        return cls.from_dict(data or {}, str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> LaminaConfig:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: a mapping of sections expected, "
                             f"got {type(data).__name__}")
        sections = typing.get_type_hints(cls)  # section name -> its dataclass
        for name in data:
            if name not in sections:
                raise ValueError(f"{source}: unknown section {name!r}; "
                                 f"known: {', '.join(sections)}")
        return cls(**{name: _section(section_cls, name, data.get(name) or {}, source)
                      for name, section_cls in sections.items()})


def _section(section_cls, name: str, values, source: str):
    """One section's dataclass from its mapping: keys and types checked here, values by
    the section's own validation."""
    if not isinstance(values, dict):
        raise ValueError(f"{source}: section {name!r} must be a mapping")
    hints = typing.get_type_hints(section_cls)
    known = [f.name for f in fields(section_cls) if f.name not in NOT_IN_FILES]
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"{source}: unknown key '{name}.{key}'; known: {', '.join(known)}")
        if not _is(value, hints[key]):
            raise ValueError(f"{source}: '{name}.{key}' must be {_name(hints[key])}, "
                             f"got {value!r}")
    try:
        return section_cls(**values)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _is(value, hint) -> bool:
    """`value` fits the annotation (int, float, bool, str, None and their unions)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _name(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_name(h) for h in typing.get_args(hint))
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))
