"""Adapters shipped inside the package (`adapters/shipped/*.safetensors`): trained once for a pair with the command
recorded in their metadata, and used as that pair's default adapter when the adapter folder has none for it."""

from __future__ import annotations

from pathlib import Path

from kvbridge.adapters.io import read_adapter_meta
from kvbridge.transfer.spec import ModelSpec

SHIPPED_FOLDER = Path(__file__).resolve().parent  # this package folder holds the files


def find_shipped(source: ModelSpec, target: ModelSpec, folder: Path | None = None) -> Path | None:
    """The shipped adapter file for exactly these two models (config hashes), or None."""
    folder = SHIPPED_FOLDER if folder is None else folder
    if not folder.is_dir():
        return None
    for path in sorted(folder.glob("*.safetensors")):
        meta = read_adapter_meta(path)
        if (meta and meta.get("source", {}).get("config_hash") == source.identity.config_hash
                and meta.get("target", {}).get("config_hash") == target.identity.config_hash):
            return path
    return None
