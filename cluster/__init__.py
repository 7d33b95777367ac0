"""lamina.cluster: Ray actors, placement, launch and job API (the only package importing ray).

Not built yet: see the disaggregated engine issue.
"""
