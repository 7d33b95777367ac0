"""The engine: requests in, step plans out, results back to outputs. Holds the config, the
scheduler, the step messages (`messages`), the detokenizer. Imports neither the kernels
nor the splitter.
"""
