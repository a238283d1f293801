"""Only safetensors are ever loaded: a pickle dressed as an adapter (or under another suffix) never runs."""

from __future__ import annotations

import pickle

import pytest
from kvbridge.server.adapter_registry import AdapterRegistry


class _Payload:
    """Unpickling this would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_is_never_loaded_as_an_adapter(tmp_path, tiny_source, tiny_target):
    import torch

    marker = tmp_path / "pwned"
    folder = tmp_path / "adapters"
    folder.mkdir()
    (folder / "evil.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    torch.save({"wk": torch.zeros(1), "x": _Payload(marker)}, folder / "torchsaved.safetensors")
    for suffix in (".pt", ".bin", ".pkl", ".ckpt"):
        (folder / f"other{suffix}").write_bytes(pickle.dumps(_Payload(marker)))
    registry = AdapterRegistry(folder, tiny_source.spec, [tiny_target.spec])
    assert registry.available() == []  # listed by nobody: not readable safetensors adapters
    for name in ("evil", "torchsaved"):
        with pytest.raises(ValueError, match="is not a safetensors file"):
            registry.load(name)
    for name in ("other", "other.pt", "other.bin"):
        with pytest.raises((FileNotFoundError, ValueError)):
            registry.load(name)
    assert registry.autoload() == []
    assert not marker.exists()
