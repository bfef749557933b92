"""The compressor family.

    pool.py   the compressor's pooling of completed groups into entries
"""
