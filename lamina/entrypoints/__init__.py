"""How users reach the engine: `LLM` (Python), the `lamina` CLI, the OpenAI-compatible HTTP
server and its engine loop, Prometheus metrics.
"""
