"""kvbridge.transfer: the exact KV foundation — models and presets, ModelSpec, KVSegment, RoPE, cache conversion,
alignment, self-checks — with the paged store (`.store`) and the target's suffix-reuse pipeline (`.suffix`) below."""

from kvbridge.transfer.exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "kvbridge.transfer.models": ["LoadedModel", "load_model", "load_packaged", "random_model", "kvbridge_home"],
    "kvbridge.transfer.presets": ["load_pair", "PRESETS"],
    "kvbridge.transfer.spec": ["ModelSpec", "ModelIdentity", "read_spec"],
    "kvbridge.transfer.segment": ["KVSegment"],
    "kvbridge.transfer.rope": ["ModelRope"],
    "kvbridge.transfer.align": ["Alignment", "TokenizedText", "align_tokens", "tokenize", "start_token_id"],
    "kvbridge.transfer.devices": ["resolve_device", "resolve_dtype"],
    "kvbridge.transfer.errors": ["NotFound", "CapacityError"],
    "kvbridge.transfer.selfcheck": ["run_selfcheck"],
})
