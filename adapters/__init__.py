"""kvbridge.adapters: per-layer K/V projection adapters between two models' KV spaces — the adapter and `project`,
fitting and training, evaluation (NLL recovery), save/load, `train-adapter`. Depends on kvbridge.transfer only."""

from kvbridge.transfer.exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "kvbridge.adapters.adapter": ["Adapter", "AdapterMeta", "project"],
    "kvbridge.adapters.io": ["load_adapter", "save_adapter"],
    "kvbridge.adapters.train": ["TrainConfig", "train_adapter"],
    "kvbridge.adapters.evaluate": ["evaluate_recovery", "prepare_documents"],
    "kvbridge.adapters.scoring": ["bootstrap_recovery", "continuation_nll"],
    "kvbridge.adapters.pairs": ["pair_text", "PairedText"],
})
