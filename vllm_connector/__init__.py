"""kvbridge.vllm: a vLLM v1 KV connector (`connector.KVBridgeConnector`) that lets a vLLM-served target start from
kvbridge's projected cache, the request convention it reads (`params`), the shared-memory hand-off between its
scheduler and worker sides (`handoff`), and an engine in vLLM's own venv driven over a pipe (`engine`, `driver`).

Only `connector` (with `engine_config` and `stats`) and `driver` import vLLM; they run in the vLLM venv
(`KVBRIDGE_VLLM=1 ./setup.sh`).
"""

from kvbridge.transfer.exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "kvbridge.vllm.params": ["ConnectorConfig", "RequestContext", "request_params", "match_prompt"],
    "kvbridge.vllm.engine": ["EngineProcess", "EngineOptions", "kv_transfer_config", "cache_salt", "vllm_available",
                             "CONNECTOR_NAME", "CONNECTOR_MODULE"],
})
