"""Cost model, first part: the hardware catalog, model shapes, and the paper's analytic
formulas (arithmetic intensity of the dense part, minimum interconnect bandwidth).

Data in: `lamina/costmodel/hardware.yaml` (or a user's YAML), HF configs or built-in LLaMA
shapes. Data out: validated `Device`s and `ModelShape`s for `lamina.costmodel.analytic` (the
throughput model and optimizer), `lamina.costmodel.simulator` and `lamina.costmodel.report`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import yaml

CATALOG = Path(__file__).parent / "hardware.yaml"
FIELDS = ("price_usd", "memory_gb", "memory_bw_gbps", "peak_tflops", "nic_gbps")


class CatalogError(ValueError):
    """A hardware catalog entry is missing, malformed or unknown."""


@dataclass(frozen=True)
class Device:
    name: str
    price_usd: float
    memory_gb: float
    memory_bw_gbps: float
    peak_tflops: float
    nic_gbps: float
    source: str = ""

    def __post_init__(self):
        for f in FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise CatalogError(f"device '{self.name}': field '{f}' must be a number, "
                                   f"got {v!r}")
            if v <= 0:
                raise CatalogError(f"device '{self.name}': field '{f}' must be positive, "
                                   f"got {v!r}")

    @property
    def usd_per_gb(self) -> float:
        return self.price_usd / self.memory_gb

    @property
    def usd_per_gbps(self) -> float:
        return self.price_usd / self.memory_bw_gbps


def load_catalog(path: str | Path | None = None) -> dict[str, Device]:
    p = Path(path) if path else CATALOG
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CatalogError(f"cannot read hardware catalog {p}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
        raise CatalogError(f"{p}: expected a mapping with a 'devices' mapping")
    out = {}
    for name, entry in data["devices"].items():
        if not isinstance(entry, dict):
            raise CatalogError(f"device '{name}': expected a mapping of fields")
        missing = [f for f in FIELDS if f not in entry]
        if missing:
            raise CatalogError(f"device '{name}': missing field(s) {missing}")
        extra = sorted(set(entry) - set(FIELDS) - {"source"})
        if extra:
            raise CatalogError(f"device '{name}': unknown field(s) {extra}")
        out[str(name)] = Device(str(name), **entry)
    return out


def device(catalog: dict[str, Device], name: str) -> Device:
    if name not in catalog:
        raise CatalogError(f"unknown device '{name}'; the catalog has {sorted(catalog)}")
    return catalog[name]


def round_half_up(x: float, digits: int) -> float:
    """Round as printed tables do (0.625 -> 0.63), not banker's rounding."""
    q = Decimal(1).scaleb(-digits)
    return float(Decimal(repr(x)).quantize(q, rounding=ROUND_HALF_UP))


# one kv head's row of one token, by KV dtype: (head_dim, weights' bytes) -> bytes
KV_ROW_BYTES = {"": lambda d, e: d * e, "float32": lambda d, e: 4 * d,
                "bfloat16": lambda d, e: 2 * d, "int8": lambda d, e: d + 4}


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float  # N, weights in the dense part
    d_model: int
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_el: int = 2  # e (fp16/bf16)
    # the memory devices' KV: "" (as the weights), "float32", "bfloat16" or "int8"
    # (lamina's int8 rows: head_dim codes and a 4-byte scale per token and kv head)
    kv_dtype: str = ""

    def __post_init__(self):
        if self.kv_dtype not in KV_ROW_BYTES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_ROW_BYTES)}, "
                             f"got {self.kv_dtype!r}")

    def kv_bytes_per_token(self) -> int:
        """K and V of one token, all layers, as the memory devices store them."""
        row = KV_ROW_BYTES[self.kv_dtype](self.head_dim, self.bytes_per_el)
        return 2 * self.layers * self.kv_heads * row

    def arithmetic_intensity(self, batch: int) -> float:
        """Dense part: 2NB FLOPs over e(N + Bd) bytes (paper section 3)."""
        return 2 * self.params * batch / (self.bytes_per_el * (self.params + batch * self.d_model))

    def min_interconnect_gbps(self, mfu: float, peak_tflops: float) -> float:
        """Paper section 4.2: 4edBL / (2NB / (MFU * peak)) = 2edL * MFU / N * peak."""
        return (2 * self.bytes_per_el * self.d_model * self.layers * mfu / self.params
                * peak_tflops * 1e12 / 1e9)


# Built-in shapes (LLaMA paper Table 2; LLaMA-2-70B uses GQA with 8 kv heads).
MODELS = {
    "llama-7b": ModelShape("llama-7b", 6.7e9, 4096, 32, 32, 128),
    "llama-13b": ModelShape("llama-13b", 13.0e9, 5120, 40, 40, 128),
    "llama-33b": ModelShape("llama-33b", 32.5e9, 6656, 60, 52, 128),
    "llama-65b": ModelShape("llama-65b", 65.2e9, 8192, 80, 64, 128),
    "llama-2-70b": ModelShape("llama-2-70b", 69.0e9, 8192, 80, 8, 128),
}


def model_shape(name_or_path: str) -> ModelShape:
    """A built-in name, or a local HF model folder (its config.json)."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    p = Path(name_or_path)
    if not (p / "config.json").is_file():
        raise ValueError(f"unknown model '{name_or_path}': not one of {sorted(MODELS)} and "
                         f"not a folder with config.json")
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(p, local_files_only=True)
    d, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    hd = getattr(c, "head_dim", None) or d // c.num_attention_heads
    kvh = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    inter = getattr(c, "intermediate_size", 4 * d)
    per_layer = d * hd * (c.num_attention_heads + 2 * kvh) + c.num_attention_heads * hd * d \
        + 3 * d * inter
    return ModelShape(p.name, float(L * per_layer + V * d), d, L, kvh, hd)


def default_mfu(batch: int, tp: int = 1, mfu_max: float = 0.60, b_half: float = 180.0,
                tp_efficiency: float = 0.80) -> float:
    """MFU of the dense part at a decode batch: it saturates like B / (B + b_half) (the
    arithmetic intensity grows with B until compute-bound) and each doubling of the
    tensor-parallel degree keeps `tp_efficiency` of it. The three constants are global
    (one set for every model and batch), chosen to match the MFU curve the paper's
    Table 3 implies for A100s; calibrate them with `lamina bench` measurements."""
    return mfu_max * tp_efficiency ** math.log2(tp) * batch / (batch + b_half)
