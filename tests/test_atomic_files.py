"""Files written through a temporary name of the writer's own (transfer/tensor_files.replaced): two runs writing one
--out never rename each other's temporary file (a fixed `.NAME.tmp` was shared: the slower run's rename failed after
its whole training, and the file was the other run's), and a write that fails leaves no temporary file."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from kvbridge.adapters import io
from kvbridge.adapters.io import load_adapter, save_adapter
from kvbridge.transfer import tensor_files
from test_adapters import random_adapter


def test_two_writers_of_one_adapter_file_both_finish_and_the_later_rename_wins(tmp_path, monkeypatch, tiny_source,
                                                                              tiny_target):
    base = random_adapter(tiny_source, tiny_target)
    first, second = (dataclasses.replace(base, meta=dataclasses.replace(base.meta, version=v)) for v in (1, 2))
    out = tmp_path / "adapter.safetensors"
    real_save, second_done, errors = tensor_files.save_file, threading.Event(), {}

    def save_file(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        if threading.current_thread().name == "first":
            assert second_done.wait(30)  # descheduled between writing its temporary file and renaming it

    monkeypatch.setattr(tensor_files, "save_file", save_file)

    def run(adapter):
        try:
            save_adapter(adapter, out)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors[threading.current_thread().name] = exc
        finally:
            if threading.current_thread().name == "second":
                second_done.set()

    writers = [threading.Thread(target=run, args=(a,), name=n) for a, n in ((first, "first"), (second, "second"))]
    writers[0].start()
    writers[1].start()
    for w in writers:
        w.join(60)
    assert errors == {}
    assert load_adapter(out).meta.version == 1  # whole, the last renamed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter.safetensors"]
    assert io.save_tensors is tensor_files.save_tensors


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "record.json"
    tensor_files.write_text(path, "old")
    with pytest.raises(RuntimeError, match="disk full"):
        with tensor_files.replaced(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_an_interrupted_write_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "record.json"
    tensor_files.write_text(path, "old")
    with pytest.raises(KeyboardInterrupt):
        with tensor_files.replaced(path) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
