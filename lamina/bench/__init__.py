"""The `lamina bench` drivers. Nothing in the runtime imports this package.
"""
