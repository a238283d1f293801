"""The `kvbridge` command: selfcheck on presets and on configs of any RoPE causal LM class; clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zoo
from kvbridge.cli import main

KVBRIDGE = Path(sys.executable).parent / "kvbridge"


def test_console_script_selfcheck_tiny():
    proc = subprocess.run([str(KVBRIDGE), "selfcheck", "--preset", "tiny", "--device", "cpu"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "selfcheck: 10 passed, 0 failed"
    for check in ("spec", "rope", "rope-real", "inject"):
        assert any(line.startswith("PASS  tiny-qwen2") and f" {check} " in line for line in lines), check
    assert not any(line.startswith("FAIL") for line in lines)


@pytest.mark.parametrize("name", ["qwen2", "phi3-partial", "llama3", "llama-yarn", "phi3-longrope", "gemma3",
                                  "mistral-sliding", "qwen3"])
def test_selfcheck_accepts_configs_of_rope_model_classes(name, tmp_path, capsys):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(zoo.configs()[name].to_dict()))
    assert main(["selfcheck", "--config", str(path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "inject" in out and "FAIL" not in out and out.strip().endswith("0 failed")


@pytest.mark.parametrize("name, message", [("gpt2", "has no rotary embedding module"),
                                           ("cohere-interleaved", "rotate_half convention")])
def test_selfcheck_refuses_models_it_cannot_handle(name, message, tmp_path, capsys):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(zoo.non_rope_configs()[name].to_dict()))
    assert main(["selfcheck", "--config", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbridge selfcheck: error:") and message in err and "Traceback" not in err


def test_selfcheck_of_a_config_refuses_the_production_weights_flags(tmp_path, capsys):
    """--source/--target name the production preset's weights; beside --config alone they were ignored (exit 0)."""
    path = tmp_path / "qwen2.json"
    path.write_text(json.dumps(zoo.configs()["qwen2"].to_dict()))
    assert main(["selfcheck", "--config", str(path), "--source", str(tmp_path / "none"), "--device", "cpu"]) == 2
    assert "--source/--target apply to the production preset" in capsys.readouterr().err


def test_unknown_preset_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["selfcheck", "--preset", "huge"])
    assert exc.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err


@pytest.mark.slow
def test_selfcheck_small_preset(capsys):
    assert main(["selfcheck", "--preset", "small", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "inject    576-token context (> sliding window 512)" in out
    assert out.strip().endswith("selfcheck: 18 passed, 0 failed")
    assert out.count(" reference ") == 2 and "FAIL" not in out


@pytest.mark.slow
def test_models_info_small(capsys):
    assert main(["models", "info", "--preset", "small", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "gemma-3-270m-q4_k_m [Gemma3ForCausalLM" in out and "smollm2-135m-instruct-q4_1 [LlamaForCausalLM" in out


def test_kvbridge_train_adapter_passes_its_options_through(capsys):
    """`kvbridge train-adapter --help` reaches train-adapter's own parser (argparse refused options there once)."""
    from kvbridge.cli import main

    with pytest.raises(SystemExit) as info:
        main(["train-adapter", "--help"])
    assert info.value.code == 0
    assert "usage: kvbridge train-adapter" in capsys.readouterr().out


def test_the_command_starts_without_loading_rouge():
    """`kvbridge serve` and every other command that scores nothing start without rouge-score and the nltk it loads
    (a second of every start here; a server machine need not have it importable)."""
    code = ("import sys; from kvbridge.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('rouge_score', 'nltk') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
