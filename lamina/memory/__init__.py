"""The memory side: the KV slot allocator (engine-side bookkeeping), the KV pool, and a
memory worker's per-step attention (`MemorySide`).
"""
