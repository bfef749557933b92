"""The cache roundings.

    rounding.py   fp8 and fp4 grids: values rounded onto a cache format and back
"""
