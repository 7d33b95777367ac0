"""How host KV pools take their pages, by default: the environment's say, read where a
config is made (torch-free, so `EngineConfig` stays light).

Data in: $LAMINA_KV_HUGE_PAGES and $LAMINA_KV_PREFAULT ("1" on, "0" off; unset: on).
Data out: `default_huge_pages()`, `default_prefault()` (lamina.memory.pool says what
each does).
"""
from __future__ import annotations

import os


def env_flag(name: str, default: bool = True) -> bool:
    """An on/off environment variable ("1"/"0"; unset: `default`); else ValueError."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw.strip() not in ("0", "1"):
        raise ValueError(f"${name} must be 0 or 1, got {raw!r}")
    return raw.strip() == "1"


def default_huge_pages() -> bool:
    return env_flag("LAMINA_KV_HUGE_PAGES")


def default_prefault() -> bool:
    return env_flag("LAMINA_KV_PREFAULT")
