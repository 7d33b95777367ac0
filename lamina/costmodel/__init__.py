"""The cost model: hardware catalog, analytic throughput-per-dollar model, discrete-event
simulator, workload generator, and the cost report.
"""
