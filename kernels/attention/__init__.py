"""The attention family.

    sparse_attention.py   sparse attention with sink over gathered window + selected compressed entries
"""
