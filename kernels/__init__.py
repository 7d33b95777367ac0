"""lamina.kernels: attention kernels for memory workers (token-slot KV layout).

Not built yet: see the KV pool / kernels issue. The reference causal attention used by
the splitter lives in `lamina.splitter.reference_attention`.
"""
