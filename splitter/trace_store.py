"""Canonical traces kept on disk, so a process's first split of a model this machine has
traced before skips torch.export.

Data in: a `CachedTrace` (the canonical graph, its light node metadata: `TensorMeta`s and
symbolic sizes as sympy expressions, and the constants that are not the model's own
tensors) and the key that says what makes models trace alike (`trace._trace_key`).
Data out: the same `CachedTrace` in a later process, or None (no file, another torch,
transformers, Python or splitter source, or a file that does not load).

Every compute worker, its replacement after a failure, and every CLI run splits the model
in a fresh process: its split of SmolLM2 takes ~10 s exporting, ~1.4 s from the store (a
Zen 3 core, `lamina bench split`). A file is the graph's nodes pickled one record each:
name, op, target, arguments and light `val`, a node read by another named, an operator
by its qualified name (as torch's own `GraphPickler` does for inductor's FX graph cache;
that module imports inductor and dynamo, ~2 s a fresh process that has not imported
transformers, which imports them itself, would otherwise pay: a weights-only compute
worker, `weights_only.py`). The weights stay out of the file and are rebound to the
model at hand, as for the in-process cache. Files live under
`$LAMINA_CACHE_DIR/traces` (default `~/.cache/lamina/traces`), the newest `STORE_FILES`
kept; `LAMINA_TRACE_CACHE=0` turns the store off. A file is a pickle: the folder is as
trusted as the rest of that cache (the kernels built there are loaded as code).
"""
from __future__ import annotations

import copy
import hashlib
import inspect
import io
import logging
import os
import pickle
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

try:  # a GraphModule that generates its code on first use (`graph_module`)
    from torch.fx._lazy_graph_module import _LazyGraphModule as _LazyGM
except ImportError:  # pragma: no cover - every torch we support has it
    _LazyGM = torch.fx.GraphModule

log = logging.getLogger("lamina.splitter")
STORE_FILES = 128  # models x dtypes x configs; a file ~0.6 MB for SmolLM2's 30 layers
FORMAT = 3  # bump when the file's layout changes (2: light node metadata; 3: node records)
_SOURCES = ("trace.py", "trace_store.py", "attention_op.py")  # what shapes the graph


@dataclass(frozen=True)
class CachedTrace:
    """A canonical traced graph without the weights it was traced with: what a model of
    the same class, config, dtypes and devices traces to (torch.export reads shapes, not
    values). `constants`: get_attr targets that are not the model's own tensors."""

    graph: torch.fx.Graph
    constants: dict


def store_dir() -> Path | None:
    """The store's folder, or None when `LAMINA_TRACE_CACHE=0` turns it off."""
    if os.environ.get("LAMINA_TRACE_CACHE", "1").strip().lower() in ("0", "off", "false"):
        return None
    base = os.environ.get("LAMINA_CACHE_DIR") or Path.home() / ".cache" / "lamina"
    return Path(base) / "traces"


def file_for(key: str, model_cls: type) -> Path | None:
    """The file for `key`: its digest with what else shapes the graph (torch's,
    transformers' and Python's versions, the splitter's sources, and the model class's
    own source file: an edited or remote-code modeling file gets its own entry). None
    when the store is off or a source cannot be read
    (nothing is stored for such a model)."""
    import transformers

    try:
        model_file = inspect.getsourcefile(model_cls)
    except (OSError, TypeError):
        return None
    return file_from(key, model_file, transformers.__version__)


def file_from(key: str, model_file: str | None, transformers_version: str) -> Path | None:
    """`file_for` from the model class's source file and transformers' version as
    given: what a process that has not imported transformers can check."""
    folder = store_dir()
    if folder is None or not key:
        return None
    h = hashlib.sha256()
    for part in (str(FORMAT), key, torch.__version__, transformers_version,
                 sys.version.split()[0]):
        h.update(part.encode() + b"\0")
    here = Path(__file__).parent
    try:
        for path in [*(here / name for name in _SOURCES), *([model_file] if model_file else [])]:
            h.update(Path(path).read_bytes())
    except OSError:
        return None
    return folder / f"{h.hexdigest()[:32]}.pkl"


class _NodePickler(pickle.Pickler):
    """Pickles a graph's nodes one record at a time: a node another refers to by its name,
    an operator by its qualified name (`torch.ops.<ns>.<name>.<overload>`)."""

    def persistent_id(self, obj):
        if isinstance(obj, torch.fx.Node):
            return ("node", obj.name)
        if isinstance(obj, torch._ops.OpOverload):
            ns, name = obj._schema.name.split("::")
            return ("op", ns, name, obj._overloadname)
        return None


class _NodeUnpickler(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self.nodes: dict[str, torch.fx.Node] = {}  # the graph's nodes so far, by name

    def persistent_load(self, pid):
        if pid[0] == "node":
            return self.nodes[pid[1]]
        _, ns, name, overload = pid
        return getattr(getattr(getattr(torch.ops, ns), name), overload)


def dumps_graph(graph: torch.fx.Graph) -> bytes:
    """`graph` (light node metadata only: `trace._keep_light_meta`) as bytes: its node
    count and codegen, then one record per node, each node it reads named."""
    buf = io.BytesIO()
    p = _NodePickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    p.dump((len(graph.nodes), graph._codegen))
    for n in graph.nodes:
        p.dump((n.name, n.op, n.target, n.args, n.kwargs, n.type,
                n.meta.get("val", _NO_VAL)))
    return buf.getvalue()


def loads_graph(blob: bytes) -> torch.fx.Graph:
    """The graph `dumps_graph` wrote, node names and metadata as they were."""
    u = _NodeUnpickler(io.BytesIO(blob))
    with warnings.catch_warnings():  # pytree's FutureWarning on its LeafSpec, unpickled
        warnings.simplefilter("ignore", FutureWarning)
        count, codegen = u.load()
    graph = torch.fx.Graph()
    for _ in range(count):
        name, op, target, args, kwargs, type_expr, val = u.load()
        node = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)
        if node.name != name:
            raise ValueError(f"node {name!r} came back as {node.name!r}")
        if val is not _NO_VAL:
            node.meta["val"] = val
        u.nodes[name] = node
    graph._codegen = codegen
    return graph


class _NoVal:
    """A node without a `val` (pickled by reference: the same object when loaded)."""


_NO_VAL = _NoVal


def save(key: str, model_cls: type, cached: CachedTrace) -> None:
    """Write `cached` for `key` and a model of class `model_cls` (atomically: concurrent
    workers may race); any failure is logged and leaves no file."""
    path = file_for(key, model_cls)
    if path is None:
        return
    try:
        blob = pickle.dumps({"key": key, "graph": dumps_graph(cached.graph),
                             "constants": cached.constants})
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            f.write(blob)
        os.replace(f.name, path)
        _prune(path.parent)
    except Exception as e:  # noqa: BLE001 - the store is an optimisation only
        log.warning("trace store: could not save %s (%s: %s)", path, type(e).__name__, e)


def load(key: str, model_cls: type) -> CachedTrace | None:
    """The trace stored for `key` and a model of class `model_cls`, or None; a file that
    does not load is removed."""
    path = file_for(key, model_cls)
    return None if path is None else load_file(path, key)


def load_file(path: Path, key: str) -> CachedTrace | None:
    """The trace in store file `path` if it holds `key`'s, else None; a file that does
    not load is removed."""
    if not path.exists():
        return None
    try:
        data = pickle.loads(path.read_bytes())
        if data["key"] != key:  # a digest collision, or a file from elsewhere
            return None
        graph = loads_graph(data["graph"])
        os.utime(path)  # recently used: kept by `_prune`
        return CachedTrace(graph, data["constants"])
    except Exception as e:  # noqa: BLE001 - traced afresh, and the file rewritten
        log.warning("trace store: dropping %s (%s: %s)", path, type(e).__name__, e)
        path.unlink(missing_ok=True)
        return None


def _prune(folder: Path) -> None:
    """Keep the newest STORE_FILES files, and no temporary file of a writer killed
    mid-write (older than an hour)."""
    def mtime(p: Path) -> float:  # another process may prune it meanwhile
        try:
            return p.stat().st_mtime
        except FileNotFoundError:
            return 0.0

    files = sorted(folder.glob("*.pkl"), key=mtime, reverse=True)
    stale = [*files[STORE_FILES:],
             *(t for t in folder.glob("*.tmp") if mtime(t) < time.time() - 3600)]
    for old in stale:
        old.unlink(missing_ok=True)


def attr_of(root, target: str):
    """`root.a.b.c` for target "a.b.c", or None where a part is missing."""
    for part in target.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def graph_module(root, graph: torch.fx.Graph, class_name: str = "GraphModule"):
    """`torch.fx.GraphModule(root, graph, class_name)` whose Python code is generated when
    it is first called (or its `.code` read), not at each construction and `recompile()`:
    a split builds each slice's module several times over (sliced, packed, fused,
    memoized), and generating code for each of those ~250 graphs (SmolLM2) was about a
    third of `prepare_split`'s time. torch's `_LazyGraphModule` (what inductor builds
    its pattern graphs with) does this; a plain GraphModule where a torch lacks it."""
    return _LazyGM(root, graph, class_name=class_name)


def compile_now(module: torch.nn.Module) -> None:
    """Generate the code of every lazily built graph module in `module` now (a split's
    final slices, once): the first step then runs no codegen, and threads sharing a
    split never meet a module mid-recompile."""
    for m in module.modules():
        recompile = getattr(m, "real_recompile", None)  # _LazyGraphModule's
        if recompile is not None:
            recompile()


def copy_graph(g: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of `g` with its own nodes (meta dicts copied, values shared) and codegen."""
    new = torch.fx.Graph()
    new.output(new.graph_copy(g, {}))
    new._codegen = copy.copy(g._codegen)
    return new
