"""A compute worker's model without transformers: its weights read from the safetensors
it loads from, bound to the trace stored for it (`splitter.weights_only`).

Data in: a model argument and dtype, as `loader.load` takes them; and, once per model,
dtype and versions, the model loaded the full way and split (`remember`).
Data out: `load_weights_only` -> a `LoadedModel` whose `model` is a `WeightsOnlyModel`,
or None where there is no valid record (the caller loads the full way, splits, and
`remember`s). `remember` -> the record's path, or None (with the reason logged).

A record holds no weights: which tensors read from which weight file (each checked equal
to the loaded model's when recorded), which names are another's tied tensor, the few
tensors the files lack (non-persistent buffers such as rotary frequencies), the config,
and the trace store file. It is used only while the weight files are unchanged (size,
mtime) and the trace file's name, recomputed from the installed torch, transformers
(its version read from the package metadata, not imported), Python, the splitter's
sources and the model's source file, is still the recorded one: anything that would
make a full load trace differently makes the record stale. Records live under
`$LAMINA_CACHE_DIR/weights_only`; `LAMINA_WEIGHTS_ONLY=0` loads the full way anyway
(`LAMINA_TRACE_CACHE=0`, the store off, too), on CPU and GPU compute workers alike
(`enabled_for`).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from lamina.splitter import trace_store
from lamina.splitter.trace import stored_trace
from lamina.splitter.weights_only import WeightsOnlyModel

from .loader import LoadedModel, _gguf_cache_path, cache_dir, resolve
from .prepare import rotary_frequencies

log = logging.getLogger("lamina.model")
RECORD_FORMAT = 1
STORED_BYTES = 1 << 22  # the most a record holds itself (tensors its weight files lack)


def _setting() -> str:
    return os.environ.get("LAMINA_WEIGHTS_ONLY", "1").strip().lower()


def _enabled() -> bool:
    return _setting() not in ("0", "off", "false")


def enabled_for(compute_device: str) -> bool:
    """Whether a compute worker whose slices run on `compute_device` starts from the
    weights alone (and records how after a full load): on CPU and on GPUs unless
    `LAMINA_WEIGHTS_ONLY=0`. GPU workers took it only when asked (`gpu`, still accepted)
    until the Ray GPU test passed that way on an H200 (benchmarks/RESULTS.md,
    2026-12-04); `bash benchmarks/gpu_check.sh ray` is that check."""
    del compute_device  # one answer for every device since then; callers still say which
    return _enabled()


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    return getattr(torch, str(dtype).split(".")[-1])


def _weights_folder(model, dtype) -> Path | None:
    """The folder a full load reads (an HF folder, or the one a GGUF was converted to),
    where it holds safetensors; else None."""
    folder, gguf = resolve(model)
    if gguf is not None:
        folder = _gguf_cache_path(folder / gguf, _dtype(dtype))
    ok = (folder / "config.json").exists() and any(folder.glob("*.safetensors"))
    return folder if ok else None


def record_dir() -> Path:
    return cache_dir() / "weights_only"


def _record_path(folder: Path, dtype) -> Path:
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24]
    tail = str(_dtype(dtype)).removeprefix("torch.")
    return record_dir() / f"{digest}-{tail}.pt"


def _stamps(folder: Path) -> dict[str, list[int]]:
    """Each weight file's and the config's [size, mtime_ns]."""
    files = [*sorted(folder.glob("*.safetensors")), folder / "config.json"]
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def _transformers_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _plan(model: torch.nn.Module, folder: Path) -> dict | None:
    """Where each of `model`'s tensors comes from: {"order", "parameters", "dtypes",
    "file": {name: weight file}, "alias": {name: first name of the same tensor},
    "stored": {name: tensor}}; None when a tensor differs from its file and is too big to
    hold in the record."""
    from safetensors import safe_open

    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    plan = {"order": [n for n, _ in named], "dtypes": {}, "file": {}, "alias": {},
            "stored": {}, "parameters": [n for n, _ in
                                         model.named_parameters(remove_duplicate=False)]}
    first: dict[int, str] = {}
    with ExitStack() as stack:
        opened = {f.name: stack.enter_context(safe_open(str(f), framework="pt"))
                  for f in sorted(folder.glob("*.safetensors"))}
        where = {k: name for name, h in opened.items() for k in h.keys()}
        for name, t in named:
            plan["dtypes"][name] = str(t.dtype).removeprefix("torch.")
            if id(t) in first:
                plan["alias"][name] = first[id(t)]
                continue
            first[id(t)] = name
            f = where.get(name)
            if f is not None:
                ft = opened[f].get_tensor(name)
                if ft.shape == t.shape and torch.equal(ft.to(t.dtype), t.detach().cpu()):
                    plan["file"][name] = f
                    continue
            held = sum(s.numel() * s.element_size() for s in plan["stored"].values())
            if held + t.numel() * t.element_size() > STORED_BYTES:
                log.info("no weights-only start for %s: %s is not as in its weight files",
                         folder, name)
                return None
            plan["stored"][name] = t.detach().cpu().clone()
    return plan


def remember(loaded: LoadedModel, dtype) -> Path | None:
    """Write the record that lets later processes load `loaded` (already split, so its
    trace is in the store) without transformers; an existing valid record is kept.
    A failure (a read-only cache, an odd weight file) is logged: records only save time."""
    try:
        return _remember(loaded, dtype)
    except Exception as e:  # noqa: BLE001
        log.warning("no weights-only record for %s (%s: %s)", loaded.source,
                    type(e).__name__, e)
        return None


def _remember(loaded: LoadedModel, dtype) -> Path | None:
    folder = _weights_folder(loaded.source, dtype)
    entry = stored_trace(loaded.model)
    if folder is None or entry is None:
        return None
    path = _record_path(folder, dtype)
    if path.exists() and _read(path, folder) is not None:
        return path
    plan = _plan(loaded.model, folder)
    if plan is None:
        return None
    import transformers

    key, trace_file = entry
    record = {"format": RECORD_FORMAT, "key": key, "trace_file": str(trace_file),
              "model_file": inspect.getsourcefile(type(loaded.model)),
              "transformers": transformers.__version__, "weights": _stamps(folder),
              "config": loaded.model.config.to_json_string(use_diff=False),
              "rotary": rotary_frequencies(loaded.model), **plan}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
        torch.save(record, f)
    os.replace(f.name, path)  # atomic: workers starting together may race
    return path


def _read(path: Path, folder: Path) -> dict | None:
    """The record at `path` if it still holds (see the module's docstring), else None."""
    rec, why = _checked(path, folder)
    if why:
        log.info("weights-only record of %s unused: %s", folder, why)
    return rec


def _checked(path: Path, folder: Path) -> tuple[dict | None, str]:
    """(the record, "") where it holds, else (None, why not)."""
    try:
        rec = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a record is an optimisation only
        return None, f"the record does not load ({type(e).__name__}: {e})"
    why = ""
    if rec.get("format") != RECORD_FORMAT:
        why = "an older record format"
    elif rec["weights"] != _stamps(folder):
        why = "the weight files changed"
    elif rec["transformers"] != _transformers_version():
        why = "transformers changed"
    elif trace_store.file_from(rec["key"], rec["model_file"], rec["transformers"]) \
            != Path(rec["trace_file"]):
        why = "torch, Python, the splitter or the model's source changed"
    elif not Path(rec["trace_file"]).exists():
        why = "its stored trace is gone"
    return (None, why) if why else (rec, "")


def status(model=None, dtype: torch.dtype | str = torch.float32) -> tuple[bool, str]:
    """Whether compute workers on this node would start `model` from its weights alone,
    and why (for `lamina doctor`): nothing is loaded."""
    if not _enabled():
        return False, "LAMINA_WEIGHTS_ONLY=0: compute workers load the model the full way"
    try:
        folder = _weights_folder(model, dtype)
    except Exception as e:  # noqa: BLE001 - a path that holds no model says so
        return False, str(e)
    if folder is None:
        return False, ("not converted yet: the first start converts it, its first compute "
                       "worker loads it the full way and records how")
    path = _record_path(folder, dtype)
    if not path.exists():
        return False, ("no record yet: the first compute worker here loads the full way "
                       "and records how")
    rec, why = _checked(path, folder)
    return (True, "compute workers read its weights alone (no transformers)") if rec \
        else (False, f"record unused ({why}): the next compute worker records it again")


def load_weights_only(model=None, dtype: torch.dtype | str = torch.float32
                      ) -> LoadedModel | None:
    """`model`'s tensors as a `WeightsOnlyModel` bound to its stored trace, where a valid
    record says how; else None (the caller loads the model the full way, which also
    reports what is wrong with a model path or a weight file)."""
    if not _enabled():
        return None
    try:
        return _load_weights_only(model, dtype)
    except Exception as e:  # noqa: BLE001
        log.info("weights-only load of %s failed (%s: %s); loading the model", model,
                 type(e).__name__, e)
        return None


def _load_weights_only(model, dtype) -> LoadedModel | None:
    from safetensors import safe_open

    t0 = time.perf_counter()
    folder = _weights_folder(model, dtype)
    path = None if folder is None else _record_path(folder, dtype)
    rec = _read(path, folder) if path is not None and path.exists() else None
    cached = rec and trace_store.load_file(Path(rec["trace_file"]), rec["key"])
    if not cached:
        return None
    tensors, by_file = dict(rec["stored"]), {}
    for name, f in rec["file"].items():
        by_file.setdefault(f, []).append(name)
    with ExitStack() as stack:
        for f, names in by_file.items():
            h = stack.enter_context(safe_open(str(folder / f), framework="pt"))
            for name in names:
                tensors[name] = h.get_tensor(name).to(getattr(torch, rec["dtypes"][name]))
    for name, first in rec["alias"].items():
        tensors[name] = tensors[first]
    wom = WeightsOnlyModel({n: tensors[n] for n in rec["order"]}, set(rec["parameters"]),
                           json.loads(rec["config"]), cached,
                           facts={"rotary": rec["rotary"] and tuple(rec["rotary"])})
    folder_of, gguf = resolve(model)
    log.info("weights-only load of %s: %.2f s", folder, time.perf_counter() - t0)
    return LoadedModel(model=wom, tokenizer=None, config=wom.config,
                       source=str(folder_of / gguf) if gguf else str(folder_of))
