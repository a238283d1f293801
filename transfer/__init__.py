"""kvbridge.transfer: the exact KV foundation.

Model loading and presets (`models`, `presets`), what a model's cache looks like (`spec`), the canonical KV form
(`segment`), RoPE on cached keys (`rope`), conversion to and from transformers caches (`kvcache`), cross-tokenizer
alignment (`align`), the self-checks (`selfcheck`), and the paged KV store (`kv_blocks` hashing and the free
queue, `block_pool` one layout's blocks, `tiers` CPU and Redis, `store` entries and tenants). Never imports
`kvbridge.adapters` or `kvbridge.server`.
"""
