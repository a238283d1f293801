"""kvbridge.adapters: per-layer K/V projection adapters between two models' KV spaces, and `train-adapter`.

Depends on `kvbridge.transfer` only.
"""
