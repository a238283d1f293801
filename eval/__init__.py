"""Evaluation of projected caches end to end: `kvbridge eval rouge` (summaries under every transfer mode, ROUGE,
NLL recovery, FLOPs, TTFT, bytes) and `kvbridge demo`."""
