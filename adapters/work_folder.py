"""The chain trainer's work folder: what each of its checkpoints was made from, and writing them whole.

Every artifact of a work folder (the teacher cache's index, ridge/ or init/, every stage's checkpoints) records the
inputs it depends on (an *inputs* dict: the corpus files' sha256, the options that shape it, the adapter it started
from). A rerun reads an artifact back only when the inputs it asks for are the recorded ones; otherwise it refuses,
naming the option that differs ("work folder W was made with --k 3; this run asks --k 2"): an artifact hours in the
making is neither recomputed over nor reused for another command without a word. An artifact that records no inputs
(written by an older kvbridge) is read back unchecked, with a warning.

A checkpoint of several files (ridge/, init/) is complete when its JSON is there: its marker is removed first, the
tensors are written (each to a temporary file renamed into place), the JSON last. One without its JSON or without a
tensor file (a run stopped while writing it, a file removed) is absent: the run computes it again and logs so.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from kvbridge.transfer.tensor_files import save_tensors, write_text

log = logging.getLogger(__name__)

# the command-line option behind each key of an inputs dict (train-adapter's); a key not here is shown as it is
OPTIONS = {"layer_map": "--layer-map", "k": "--k", "token_rank": "--token-rank", "source_rank": "--source-rank",
           "ridge_windows": "--ridge-windows", "dev_per_corpus": "--dev-per-corpus", "seed": "--seed",
           "train_windows": "--train-windows", "fuser_rank": "--fuser-rank", "answer_windows": "--answer-windows",
           "answer_dev": "--answer-dev", "answer": "--answer-lengths", "context": "--context-window/--context-rank/"
           "--context-no-norm", "teacher": "--context-tokens/--continuation-tokens", "before": "--stages (the stages "
           "before this one)", "doc_chars": "doc_chars"}


def corpus_digest(files: Iterable[str | Path]) -> dict[str, str]:
    """{file name: sha256 of its bytes} of the corpus files, in the order given."""
    out = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[Path(f).name] = h.hexdigest()
    return out


def ids_digest(ids: Iterable[str]) -> str:
    """sha256 of a sequence of window ids (which windows, in which order, an artifact read)."""
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()


def _corpus(saved: dict, wanted: dict) -> str:
    changed = [n for n in wanted if n in saved and saved[n] != wanted[n]]
    if changed:
        return "; ".join(f"the corpus file {n} has changed since (sha256 {saved[n][:12]}... then, {wanted[n][:12]}... "
                         "now)" for n in changed)
    return f"was made with --corpus {' '.join(saved)}; this run asks --corpus {' '.join(wanted)}"


def _init(value: str | None) -> str:
    return "from a ridge fit (no --init)" if not value else f"with an --init adapter of sha256 {value[:12]}..."


def _show(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def differences(saved: dict, wanted: dict) -> list[str]:
    """What differs between two inputs dicts, each as a clause naming the option ("was made with --k 3; this run asks
    --k 2"); the starting points ("start") compared key by key when they are of one kind (both a ridge fit, or both
    an --init adapter). Other windows are named only when no option that selects them is."""
    if saved.get("init", "") != wanted.get("init", ""):  # another kind of start: its options are not comparable
        return [f"was made {_init(saved.get('init'))}; this run starts {_init(wanted.get('init'))}"]
    out, windows = [], False
    for key in [*wanted, *(k for k in saved if k not in wanted)]:
        a, b = saved.get(key), wanted.get(key)
        if a == b:
            continue
        if key == "start" and isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b)
        elif key == "windows":
            windows = True
        elif key == "corpus" and isinstance(a, dict) and isinstance(b, dict):
            out.append(_corpus(a, b))
        else:
            option = OPTIONS.get(key, key)
            out.append(f"was made with {option} {_show(a)}; this run asks {option} {_show(b)}")
    if windows and not out:
        out.append("was made from other windows (the dev and ridge windows another --train-windows selects)")
    return out


_unchecked: set[Path] = set()  # artifacts of an older kvbridge this process was told of


def check_inputs(saved: dict | None, wanted: dict, work: Path, part: Path, what: str) -> None:
    """Raise ValueError naming every option that differs when `saved` (an artifact's recorded inputs) is not `wanted`
    (this run's); `part`: the artifact's file or folder under the work folder `work`, `what` it is. saved None: an
    artifact of an older kvbridge, read back unchecked (logged)."""
    if saved is None:
        if part not in _unchecked:  # (once a process: the chain checks up front, the trainer again at resume)
            _unchecked.add(part)
            log.warning("%s (%s) records no inputs (an older kvbridge wrote it): read back unchecked", part, what)
        return
    diffs = differences(saved, json.loads(json.dumps(wanted)))  # (as recorded: tuples are lists)
    if diffs:
        raise ValueError(f"work folder {work} ({what}, {part.relative_to(work) if part.is_relative_to(work) else part}"
                         f") {'; '.join(diffs)}: use another --work or remove {part}")


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically: a temporary file renamed into place."""
    write_text(path, json.dumps(data))


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """save_file atomically: a temporary file renamed into place."""
    save_tensors(path, {k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)


def begin_checkpoint(folder: Path, marker: str) -> None:
    """Before writing a checkpoint's files: the folder made, its marker (the JSON written last) removed, so a run
    stopped in between leaves a checkpoint `read_checkpoint` calls incomplete."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / marker).unlink(missing_ok=True)


def read_checkpoint(folder: Path, marker: str, files: tuple[str, ...]) -> dict | None:
    """The checkpoint's JSON (its marker) when it is complete: the marker readable and every file there. None when
    there is none, or (logged) when it is incomplete: the caller computes it again."""
    present = [name for name in (marker, *files) if (folder / name).is_file()]
    if not present:
        return None
    missing = [name for name in (marker, *files) if name not in present]
    if not missing:
        try:
            return json.loads((folder / marker).read_text())
        except ValueError:
            missing = [f"{marker} (not JSON)"]
    log.warning("%s holds an incomplete checkpoint (%s missing): computing it again", folder, ", ".join(missing))
    return None
