"""The sparse indexer family: scores of queries against their chunk's compressed keys, and the selection of entries.

    index_scores.py   the indexer's scores
    topk.py           top-k entries of a row, candidate blocks (radix select per row)
"""
