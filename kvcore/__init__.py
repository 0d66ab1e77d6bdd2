"""The bottom layer, below both `harness/` and `methods/`: errors and the tiered KV store.

Import order is downward only: harness -> methods -> kvcore (tasks sit beside harness and may
import methods and kvcore). Nothing here imports transformers, harness or methods.
"""
