"""kvbridge.transfer: the exact KV foundation.

Model loading and presets (`models`, `presets`), what a model's cache looks like (`spec`), the canonical KV form
(`segment`), RoPE on cached keys (`rope`), conversion to and from transformers caches (`kvcache`), cross-tokenizer
alignment (`align`), and the self-checks (`selfcheck`). Never imports `kvbridge.adapters` or `kvbridge.server`.
"""
