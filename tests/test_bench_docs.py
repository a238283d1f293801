"""bench/README.md's section on bench_all's rows states every goal the table prints (a goal the code judges a row
by, missing from the docs, reads as "no goal")."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def _rows_section() -> str:
    text = (BENCH / "README.md").read_text(encoding="utf-8")
    start = text.index("### The rows")
    return " ".join(text[start:text.index("\n### ", start + 1)].split())


def test_every_ttft_goal_the_table_prints_is_in_the_readme():
    import bench_all
    import bench_ttft

    fields = {f.name: 1.0 for f in dataclasses.fields(bench_ttft.TTFTResult)}
    result = bench_ttft.TTFTResult(**{**fields, "context_tokens": bench_ttft.GOAL_TOKENS, "question_tokens": 11,
                                      "rounds": 1, "prior_layers": 1, "wire_bytes": 1, "same_first_token": True})
    rows = bench_all.ttft_rows([result.as_dict()], bench_ttft.GOAL, bench_ttft.GOAL_TOKENS)
    section = _rows_section()
    goals = {(row.measurement.split(" @")[0], row.goal) for row in rows if row.goal != "-"}
    assert goals, rows
    for kind, goal in goals:
        # each goal beside the row it judges: "<= 0.04 at 2k" for the warm rows, "<= 0.15 at 2k" for the cold one
        assert f"{goal} at 2k" in section.replace("*", ""), f"the README's rows say nothing of {kind}'s goal {goal}"
    cold = next(row for row in rows if row.measurement.endswith("(cold)"))
    assert cold.goal != "-" and "`(cold)` row is" in section, "the cold row's goal is not in the README"
