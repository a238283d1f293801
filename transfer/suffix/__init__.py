"""kvbridge.transfer.suffix: the target's suffix-reuse pipeline — entropy detector, session cache manager, value
scorer, placement and recompute of reused KV, and the generator that assembles requests from them."""

from kvbridge.transfer.exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "kvbridge.transfer.suffix.detector": ["SuffixDetector", "DetectorConfig", "attention_entropy"],
    "kvbridge.transfer.suffix.cache_manager": ["SuffixCacheManager", "ManagerConfig"],
    "kvbridge.transfer.suffix.value_score": ["OnlineValueScorer", "FixedScorer", "ValueScorer", "SegmentFeatures"],
    "kvbridge.transfer.suffix.reuse": [
        "place", "prefill_after", "recompute_first", "recompute_selected", "recompute_most_deviating"],
    "kvbridge.transfer.suffix.generator": [
        "SuffixReuseGenerator", "Part", "RequestMetrics", "ContextSource", "model_lock"],
    # the function `blend` is not exported: `kvbridge.transfer.suffix.blend` is its module (import it from there)
    "kvbridge.transfer.suffix.blend": ["BlendConfig"],
})
