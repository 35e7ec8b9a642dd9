"""Attention backends: one model forward, many places to keep keys and values.

`core.AttentionCore` is the math; `backend.AttentionBackend` the protocol; `static.KVCache`,
`paged.PagedAttention` (over `paged.PagedKVCache` and a `paged.StepBatch`) and
`past.PastKeyValues` the backends (see `llmopt.models.attention.backend`).
"""
