"""The Engram family.

    gate.py        Engram's gate onto the streams
    hash_rows.py   Engram's n-gram hash and table gather (dequantized fp8 rows)
"""
