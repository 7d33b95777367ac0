"""The data plane between processes: frames and socket / shared-memory channels
(`transport`), the per-layer q|k|v and o|lse protocol (`protocol`), and the once-per-
step control channel (`control`).
"""
