"""The benchmarks refuse bad options before they start anything (a model load, a server, a vLLM engine), with an
error that names the option; and what their help says they default to is what they do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:  # bench/ is not a package: its modules import each other by name
    sys.path.insert(0, str(BENCH))


def _refused(capsys, fn, argv: list[str]) -> str:
    """fn(argv) exits with argparse's usage error (2); its message."""
    with pytest.raises(SystemExit) as exc:
        fn(argv)
    assert exc.value.code == 2, f"{argv}: exited {exc.value.code!r}, not the usage error 2"
    return capsys.readouterr().err


def test_bench_all_refuses_a_json_path_it_could_not_write_before_the_run(tmp_path, capsys):
    import bench_all

    # written only after every piece ran (minutes): a path that cannot be written must be refused up front
    parse = lambda argv: bench_all.parse_args(argv, None)  # noqa: E731
    err = _refused(capsys, parse, ["--json", str(tmp_path / "no-such-folder" / "out.json")])
    assert "--json" in err and "no-such-folder" in err, err
    err = _refused(capsys, parse, ["--json", str(tmp_path)])
    assert "--json" in err and "folder" in err, err
    assert bench_all.parse_args(["--json", str(tmp_path / "out.json")], None).json == str(tmp_path / "out.json")


@pytest.mark.parametrize("name", ["bench_vllm", "bench_vllm_openai"])
@pytest.mark.parametrize("argv, option", [(["--rounds", "0"], "--rounds"), (["--tokens", "1"], "--tokens"),
                                          (["--block-size", "0"], "--block-size")])
def test_the_vllm_benchmarks_refuse_bad_counts_before_the_engine(name, argv, option, monkeypatch, tmp_path, capsys):
    import importlib

    # no vLLM venv here, whatever the machine has: nothing can start an engine, with or without the check
    monkeypatch.setenv("KVBRIDGE_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    bench = importlib.import_module(name)
    err = _refused(capsys, bench.run, argv)
    assert f"{option} must be >= " in err, err


@pytest.mark.parametrize("name, argv, option", [
    ("bench_ttft", ["--rounds", "0"], "--rounds"),
    ("bench_suffix", ["--quick", "--turns", "0"], "--turns"),
    ("bench_prefix", ["--quick", "--rounds", "0"], "--rounds"),
    ("bench_grpc", ["--quick", "--rounds", "0"], "--rounds"),
    ("bench_grpc", ["--quick", "--tokens", "0"], "--tokens"),
    ("bench_projection", ["--preset", "tiny", "--rounds", "0"], "--rounds"),
    ("bench_projection", ["--preset", "tiny", "--tokens", "0"], "--tokens"),
    ("bench_fidelity", ["--quick", "--docs", "0"], "--docs"),
])
def test_a_count_of_zero_is_refused_not_taken_for_the_default(name, argv, option, capsys):
    import importlib

    bench = importlib.import_module(name)
    # bench_ttft's parse is its own function; the others parse at the start of run(), before any model loads
    err = _refused(capsys, bench.parse_args if name == "bench_ttft" else bench.run, argv)
    assert f"{option} must be " in err and "got 0" in err, err


@pytest.mark.parametrize("name", ["bench_ttft", "bench_suffix", "bench_grpc", "bench_all"])
def test_the_adapter_help_names_the_shipped_adapter_the_bench_takes_by_default(name, capsys):
    import importlib

    # bench_suffix.get_adapter, which each of them calls: the --adapter file, else the pair's shipped adapter, else a
    # ridge fit; a help that promises a ridge fit sends users to fit one to get what they already got
    bench = importlib.import_module(name)
    with pytest.raises(SystemExit) as exc:
        if name == "bench_ttft":
            bench.parse_args(["--help"])
        elif name == "bench_all":
            bench.parse_args(["--help"], None)
        else:
            bench.run(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--adapter" in out and "shipped" in out, out
