"""Executors run a `StepPlan` and return a `StepResult`: the interface (`base`) and the in-
process `LocalExecutor`. The Ray executor lives in `lamina.cluster`.
"""
