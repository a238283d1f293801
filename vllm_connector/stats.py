"""The connector's counters in vLLM's KV connector stats (`KVConnectorStats`): what the workers' save uploads did.
A worker hands its counts since the last step with each step's output (`KVBridgeConnector.get_kv_connector_stats`);
vLLM sums them over workers and steps and, where it logs stats (`vllm serve`; `LLM(..., disable_log_stats=False)`),
prints them every interval: "KV Transfer metrics: saves_stored=2, saved_tokens_stored=1024, saves_failed=0".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = ("saves_stored", "saved_tokens_stored", "saves_failed")  # uploads stored, their tokens, uploads failed


@dataclass
class KVBridgeStats(KVConnectorStats):
    """Counts since the last report: data = {counter: int} for COUNTERS (missing: 0)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, count in other.data.items():
            self.data[name] = self.data.get(name, 0) + count
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def build(data: dict[str, Any] | None) -> KVBridgeStats:
    return KVBridgeStats(data=dict(data or {}))
