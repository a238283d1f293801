"""The evaluation data: a JSONL file of records with a document and its reference summary (an empty one: a document
without a reference, measured against the target's own answer only)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from kvbridge.transfer.data import jsonl_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    id: str
    document: str
    summary: str


def read_records(path: str | Path, exclude: str | Path | None = None) -> list[Record]:
    """Records of a JSONL file with string fields id, document and summary; those whose id is in the `exclude`
    file (`read_ids`: records, or lines of an id alone) are left out. An exact repeat of a record is dropped; a
    different record under an id already seen gets the id `ID#2` (`#3`, ...; the first such name no record of the
    file has) and a warning (pydoc_summaries.jsonl has two unittest.mock pages)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    skip = read_ids(exclude) if exclude else set()
    rows = list(jsonl_rows(path))
    given = {obj["id"] for _, obj in rows if isinstance(obj, dict) and isinstance(obj.get("id"), str)}
    records, seen, copies = [], set(), {}
    for n, obj in rows:
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object with id, document and summary")
        for key in ("id", "document"):
            if not isinstance(obj.get(key), str) or not obj[key].strip():
                raise ValueError(f"{path}:{n}: field {key!r} must be a non-empty string")
        if not isinstance(obj.get("summary"), str):
            raise ValueError(f"{path}:{n}: field 'summary' must be a string (empty: no reference summary)")
        record = Record(obj["id"], obj["document"], obj["summary"])
        if record in seen:
            log.warning("%s:%d: a repeat of an earlier record (id %r): dropped", path, n, record.id)
            continue
        seen.add(record)
        copies[record.id] = copies.get(record.id, 0) + 1
        if copies[record.id] > 1:
            renamed = f"{record.id}#{copies[record.id]}"
            while renamed in given:  # a record of the file has that id (`a#2`): another name, so ids stay unique
                copies[record.id] += 1
                renamed = f"{record.id}#{copies[record.id]}"
            given.add(renamed)
            log.warning("%s:%d: id %r is taken by another record: this one is %r", path, n, record.id, renamed)
            record = Record(renamed, record.document, record.summary)
        if record.id not in skip and obj["id"] not in skip:  # an excluded id excludes every record under it
            records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records" + (f" outside {exclude}" if skip else ""))
    return records


def read_ids(path: str | Path) -> set[str]:
    """The ids of a JSONL file of objects with a string field id (records, or `{"id": ...}` lines alone)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"exclude file {path} does not exist")
    ids = set()
    for n, obj in jsonl_rows(path):
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not obj["id"].strip():
            raise ValueError(f"{path}:{n}: field 'id' must be a non-empty string (an --exclude file holds JSON "
                             "objects with an id)")
        ids.add(obj["id"])
    return ids
