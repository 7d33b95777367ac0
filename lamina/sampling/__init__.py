"""Sampling: `SamplingParams` (what a request asks for; light) and the sampler that draws
tokens from logits on the compute side.
"""
