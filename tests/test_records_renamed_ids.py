"""--exclude naming a renamed record's id (a#2, as results.json rows carry it) excludes that record and keeps the
first record under a."""

from __future__ import annotations

from kvbridge.eval.records import read_records


def test_excluding_a_renamed_id_excludes_that_record(tmp_path):
    a, b = '{"id": "a", "document": "x", "summary": "y"}', '{"id": "a", "document": "z", "summary": "w"}'
    data = tmp_path / "data.jsonl"
    data.write_text(a + "\n" + b + "\n")
    skip = tmp_path / "skip.jsonl"
    skip.write_text('{"id": "a#2"}\n')
    assert [(r.id, r.document) for r in read_records(data, exclude=skip)] == [("a", "x")]
