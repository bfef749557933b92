"""The rotary embedding family.

    rope.py   interleaved rotary embedding, over tokens or compressed entries
"""
