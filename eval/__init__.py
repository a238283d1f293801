"""kvbridge.eval: evaluation of projected caches end to end — `kvbridge eval rouge` (summaries under every transfer
mode, ROUGE, NLL recovery, FLOPs, TTFT, bytes), `kvbridge demo`, and labelled sets (the suffix detector's)."""

from kvbridge.transfer.exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "kvbridge.eval.run": ["RunOptions", "evaluate"],
    "kvbridge.eval.demo": ["run_demo"],
    "kvbridge.eval.summaries": ["EvalConfig", "SummaryEvaluator"],
})
