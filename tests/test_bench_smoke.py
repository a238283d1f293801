"""bench/bench_all.py --quick (which runs bench_store.py, bench_grpc.py and bench_suffix.py --quick as pieces) and
bench/bench_prefix.py --quick run to the end and print every benchmark; `kvbridge bench` forwards to bench_all.
No timing is asserted (STYLE 9): the numbers belong to the machine that printed them."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_store.py"
BENCH_ALL = BENCH.with_name("bench_all.py")
TABLE_HEADER = "| measurement | ratio | goal | detail |"
# bench_all --quick's table: one row per ratio (TTFT at its quick context lengths, 256 and 512 tokens)
ALL_QUICK_ROWS = (
    "TTFT replace/full @256 (warm, same host)", "TTFT replace/full @256 (warm, stream)",
    "TTFT served blend:0.1/full @256 (warm, same host)", "TTFT replace/full @256 (cold)",
    "TTFT blend:0.1/full @256 (warm)",
    "TTFT blend:0.1 with/without induction prior @256",
    "TTFT replace/full @512 (warm, same host)", "TTFT replace/full @512 (warm, stream)",
    "TTFT served blend:0.1/full @512 (warm, same host)", "TTFT replace/full @512 (cold)",
    "TTFT blend:0.1/full @512 (warm)",
    "TTFT blend:0.1 with/without induction prior @512",
    "projection/prefill speed @",
    "fidelity replace/noprior (ROUGE-L vs full)", "fidelity replace (ROUGE-L vs full)",
    "fidelity served:blend:0.1 (ROUGE-L vs full)", "fidelity blend:0.1 (ROUGE-L vs full)",
    "store get/copy source @2048",
    "store get/copy source @2047", "store get/copy target @2048", "store get/copy target @2047",
    "store lookup per block", "store hash_chain/lookup", "store tokens/pool (distinct entries)",
    "store tokens/pool (shared 1024-token prefix)", "store tokens/pool (growing conversation)",
    "store bytes held/capacity (mixed layouts)", "redis tier/raw put",
    "redis tier/raw get", "redis cluster tier/raw put", "redis cluster tier/raw get", "gRPC stream grpc/raw",
    "gRPC wire projected/source", "suffix prefilled tokens without/with", "suffix TTFT median without/with",
    "suffix TTFT sum without/with",
)
# each benchmark's lines start with its tag; among them, its ratio and its goal
BENCHMARKS = ("get", "lookup", "capacity", "redis", "budget")
# loose bounds on every printed ratio: no timing asserted (STYLE 9), but a zero, a negative, an infinity or a
# ratio of a thousand is a broken measurement, not a slow machine
RATIO_RANGE = (0.0, 100.0)
NUMBER = r"(\d[\d,]*(?:\.\d+)?)"  # as the benchmarks print them: 1,544 or 0.68 or 19.9


def _number(text: str) -> tuple[float, float]:
    """A printed figure and half its last digit (what rounding may have taken off or added)."""
    digits = text.replace(",", "")
    decimals = len(digits.partition(".")[2])
    return float(digits), 0.5 * 10.0 ** -decimals


def _check_ratio(ratio: float, what: str, figures: tuple[str, str] | None = None) -> None:
    """ratio is finite and within RATIO_RANGE; figures: the printed numerator and denominator it was computed
    from, which it must equal up to their rounding."""
    low, high = RATIO_RANGE
    assert math.isfinite(ratio) and low < ratio < high, f"{what}: ratio {ratio} is not in ({low}, {high})"
    if figures is None:
        return
    (a, da), (b, db) = _number(figures[0]), _number(figures[1])
    smallest = max(a - da, 0.0) / (b + db)
    largest = (a + da) / (b - db) if b - db > 0 else math.inf
    assert smallest * 0.999 <= ratio <= largest * 1.001, (
        f"{what}: ratio {ratio} is not {figures[0]} / {figures[1]} (between {smallest:.4g} and {largest:.4g})")


def _check_table_ratios(cells: list[list[str]], rows: list[dict]) -> None:
    """Each table row: its printed ratio equals its JSON value to the printed digits, lies in RATIO_RANGE, and is
    the quotient of the two figures its detail starts with ("A vs B") or names (tokens held by a pool)."""
    for (name, printed, _, detail), row in zip(cells, rows):
        shown = re.match(NUMBER, printed)
        assert shown, f"{name}: ratio cell {printed!r} is not a number"
        value, half = _number(shown.group(1))
        assert abs(value - row["value"]) <= half * 1.001, f"{name}: printed {printed}, JSON value {row['value']}"
        if name.startswith("fidelity "):  # a quality, not a ratio: a ROUGE-L mean inside its printed interval
            low, high = map(float, re.match(r"\[(\S+), (\S+)\]", detail).groups())
            assert 0.0 <= low <= row["value"] + 5e-4 and row["value"] <= high + 5e-4 <= 1.0 + 5e-4, (name, detail)
            continue
        pair = re.match(rf"{NUMBER}(?: \S+)? vs {NUMBER}", detail)
        pool = re.match(rf"{NUMBER} tokens in .* held by a {NUMBER}-token pool", detail)
        figures = pair or pool
        _check_ratio(row["value"], name, figures.groups() if figures else None)


def _check_store_piece(lines: list[str], out: str) -> None:
    """bench_store --quick's lines: its machine line, a ratio and a goal for every benchmark, nothing skipped."""
    assert lines and lines[0].startswith("machine: "), out
    assert "quick run" in lines[0] and "device " in lines[0] and "torch " in lines[0], lines[0]
    for tag in BENCHMARKS:
        mine = [line for line in lines if line.split(" ", 1)[0] == tag]
        assert any("ratio" in line for line in mine), f"no {tag!r} ratio line in:\n{out}"
        assert any("goal" in line for line in mine), f"no {tag!r} goal in:\n{out}"
    assert not any("skipped" in line for line in lines), out
    assert lines[-1].startswith("done in "), out


def _check_grpc_piece(lines: list[str], out: str) -> None:
    """bench_grpc --quick's lines: the stream against a server in its own process, shm and wire ratios."""
    assert lines and lines[0].startswith("machine: "), out
    assert "quick run" in lines[0], lines[0]
    stream = [line for line in lines if line.split(" ", 1)[0] == "stream"]
    assert any("ratio" in line and "goal" in line for line in stream), f"no stream ratio and goal in:\n{out}"
    assert any("server in its own process" in line for line in stream), f"not the deployed layout:\n{out}"
    shm = [line for line in lines if line.split(" ", 1)[0] == "shm"]
    assert len(shm) == 1 and "ratio memcpy/shm" in shm[0] and "goal >= 0.8" in shm[0], f"no shm line in:\n{out}"
    wire = [line for line in lines if line.split(" ", 1)[0] == "wire"]
    assert any("measured" in line and "ratio" in line for line in wire), f"no measured wire ratio in:\n{out}"
    assert lines[-1].startswith("done in "), out


def _check_suffix_piece(lines: list[str], out: str) -> None:
    """bench_suffix --quick's lines: prefill and TTFT ratios, the reuse and answers lines."""
    assert lines and lines[0].startswith("machine:"), out
    for tag in ("prefill", "ttft"):
        mine = [line for line in lines if line.split(" ", 1)[0] == tag]
        assert mine and all("ratio" in line for line in mine), f"no {tag!r} ratio line in:\n{out}"
    for tag in ("reuse", "answers"):
        assert any(line.split(" ", 1)[0] == tag for line in lines), f"no {tag!r} line in:\n{out}"
    assert lines[-1].startswith("done in "), out


def _pieces(out: str) -> dict[str, list[str]]:
    """bench_all's output cut at its `### name: title` headers: each piece's non-empty lines under its name."""
    pieces, name = {}, None
    for line in out.splitlines():
        if line.startswith("### "):
            name = line[4:].split(":", 1)[0]
            pieces[name] = []
        elif name is not None and line.strip() and not line.startswith("json written to "):  # bench_all's own
            pieces[name].append(line)
    return pieces


@pytest.mark.integration
def test_bench_prefix_quick_runs_and_prints_its_ratio():
    bench = BENCH.with_name("bench_prefix.py")  # the tiny pair, 2,304 token ids: seconds of work
    proc = subprocess.run([sys.executable, str(bench), "--quick", "--rounds", "1"], cwd=bench.parents[1],
                          capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"bench exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-4000:]}"
    lines = out.splitlines()
    assert lines[0].startswith("machine:") and lines[-1].startswith("prefix "), out
    assert "2048 cached + 256 new tokens vs a fresh 2304-token Ingest" in lines[-1] and " = " in lines[-1], out
    # the extending Ingest against the fresh one: both timed, the quotient printed, and the cached prefix reused
    figures = re.search(rf"{NUMBER} ms vs {NUMBER} ms = {NUMBER} \(goal", lines[-1])
    assert figures, lines[-1]
    extend, fresh, ratio = figures.groups()
    _check_ratio(float(ratio), "prefix extend/fresh", (extend, fresh))
    assert float(fresh) > 0 and "; 2048 source tokens reused in all" in lines[-1], lines[-1]


@pytest.mark.integration
@pytest.mark.slow
def test_bench_all_quick_prints_one_row_per_ratio(tmp_path):
    from redisproc import redis_available

    if not redis_available():
        pytest.fail("no redis-server (or valkey-server) on PATH: the store piece's Redis rows need a real one. "
                    "Install it with apt-get install redis-server.")
    # about 2 minutes on a 2-core VM (the small pair's load and adapter fit included); the bound leaves room for
    # converting the packaged models on a fresh machine
    out_json = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH_ALL), "--quick", "--json", str(out_json)],
                          cwd=BENCH_ALL.parents[1], capture_output=True, text=True, timeout=900, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"bench exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-4000:]}"
    lines = out.splitlines()
    assert lines and lines[0].startswith("machine: ") and "quick run" in lines[0], out
    assert TABLE_HEADER in lines, f"no summary table in:\n{out}"
    table = lines[lines.index(TABLE_HEADER) + 2:]  # after the header and its |---| line
    rows_at_end = all(line.startswith("| ") and line.endswith(" |") for line in table)
    assert table and rows_at_end, f"the output does not end with the table:\n{out}"
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    names = [row[0] for row in cells]
    for expected in ALL_QUICK_ROWS:
        assert sum(name.startswith(expected) for name in names) == 1, f"no single row {expected!r} in:\n{out}"
    assert len(names) == len(ALL_QUICK_ROWS), f"unexpected rows {names}"
    for row in cells:
        assert len(row) == 4 and row[1] not in ("FAILED", "skipped"), row
    # bench_all runs bench_store, bench_grpc and bench_suffix --quick as their own command lines do: each prints
    # every benchmark (these pieces are checked here rather than run a second time on their own)
    pieces = _pieces(out)
    _check_store_piece(pieces["store"], out)
    _check_grpc_piece(pieces["grpc"], out)
    _check_suffix_piece(pieces["suffix"], out)
    fidelity = [line for line in pieces["fidelity"] if line.startswith("fidelity ")]
    assert len(fidelity) == 4 and all("ROUGE-L vs full" in line and "greedy agreement" in line
                                      and "NLL recovery" in line for line in fidelity), out
    report = json.loads(out_json.read_text())
    assert report["machine"] == lines[0] and report["errors"] == {}, report["errors"]
    assert [row["measurement"] for row in report["rows"]] == names
    assert all(isinstance(row["value"], float) for row in report["rows"]), report["rows"]
    _check_table_ratios(cells, report["rows"])


def test_kvbridge_bench_forwards_its_options_to_bench_all(capsys):
    import kvbridge.cli as cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--quick", "--help"])  # options reach bench_all's parser, which prints its help
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvbridge bench") and "--json" in out and "--full" in out, out


def test_kvbridge_bench_without_the_repository_says_so(monkeypatch, tmp_path, capsys):
    import kvbridge.cli as cli

    # as in an installed wheel: the package lies in site-packages, with no bench folder beside it
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "kvbridge" / "cli" / "__init__.py"))
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "kvbridge bench: error:" in err and "bench_all.py" in err and "source checkout" in err, err
