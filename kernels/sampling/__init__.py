"""The engine's sampling kernels: no DSL op, the sampler calls them.

    gumbel_argmax.py   seeded sampling's draw: hashed Gumbel noise, argmax over a row (greedy rows too)
"""
