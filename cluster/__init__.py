"""lamina.cluster: Ray placement and supervision of compute and memory workers.

`RayExecutor` (executor.py) creates one `ComputeWorker` (compute_worker.py) and N
`MemoryWorker`s (memory_worker.py) and wires their socket data plane; `LLM(executor="ray")`
finds it through `lamina.executor.base.PLUGINS`. This is the only package that imports ray.
"""
