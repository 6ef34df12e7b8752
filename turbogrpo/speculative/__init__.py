"""Speculative rollouts: an EAGLE-style draft head proposes token trees that the policy verifies.

``verify`` (lossless acceptance), ``tree`` (EAGLE-2 dynamic trees), ``draft`` (the draft head),
``policy``/``profiler`` (concurrency-aware tree sizing) and ``decode`` (the decoding loop).
"""
