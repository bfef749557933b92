"""The pools' kernels: no DSL op, the runtime's cache pools call them.

    rows.py   cache entries encoded and scattered into their pools, gathered and decoded
"""
