"""The compute side's step: packing a plan, running the model slices, local prefill,
sampling; and `MemoryLink`, its interface to the memory workers.
"""
