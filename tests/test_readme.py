"""README.md's code blocks, run or checked, so that a newcomer's first five minutes work.

Every fenced block is claimed by one check (test_every_block_is_claimed):

- the quick start's two commands: `./setup.sh` and the test command are what .ci/run runs (setup is not run here:
  .ci/run is that run);
- the Python client: run as it stands against a real in-process server of the small pair (slow; the same snippet
  against a `kvbridge serve` process: tests/test_serve_cli.py);
- the Node.js session: its install block and client.js, run against an in-process server with a bearer token
  (skipped, saying why, without node and npm or when the npm registry cannot be reached);
- the grpcurl session: run where grpcurl and jq are on the PATH, skipped elsewhere (they are not installable on
  the machines kvbridge is developed on);
- vLLM: the OpenAI server's command line is checked against `kvbridge.vllm` (its connector config parses to the
  one `kv_transfer_config` builds, its environment is the engine's); the curl block runs in
  tests/test_vllm_openai.py against a real vLLM server when .venv-vllm exists; `kvbridge demo --engine vllm` is
  parsed here and its engine path runs in tests/test_vllm.py (the evaluation through vLLM);
- every other shell command (`kvbridge ...`, `train-adapter ...`, scripts): parsed by the command's own argparse
  parser, scripts checked to exist; the cheap one (`kvbridge models info --preset production`) runs. GPU commands
  (`kvbridge serve --preset production`, `bench/gpu_check.sh`) and the long ones (`data build --install`, `eval
  rouge`, `train-adapter`, `bench`) are only parsed; tests/test_corpus.py runs the real data build where the
  Debian packages are installed, tests/test_bench_smoke.py the benchmarks.

And the README's promises about itself: its configuration reference names every `kvbridge serve` flag, every
connector field and every KVBRIDGE_ environment variable the code reads; its links and the docs' stay inside the
repository and resolve.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from readme_blocks import README, ROOT, blocks, python_client, shell_commands

pytestmark = pytest.mark.integration

KINDS = {"setup", "tests", "python-client", "node-install", "node-client", "grpcurl", "vllm-server", "vllm-curl",
         "commands", "output"}
CHEAP = {".venv/bin/kvbridge models info --preset production": "57,344 KV bytes/token"}
NETWORK_ERRORS = ("ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET", "ENETUNREACH",
                  "network request", "request to https://registry")
NEW_DOCS = ("docs/library.md", "docs/serving.md", "docs/adapters.md", "docs/answers.md", "docs/context-map.md",
            "docs/quality.md", "docs/fidelity-ceiling.md", "docs/vllm.md", "docs/deployment.md")


def kind(block) -> str:
    body = block.text.strip()
    if block.lang == "text":
        return "output"
    if block.lang == "js":
        return "node-client"
    if block.lang == "python":
        return "python-client" if "KVBridgeClient(" in body else "unclaimed"
    if block.lang != "bash":
        return "unclaimed"
    if body == "./setup.sh":
        return "setup"
    if body == ".venv/bin/python -m pytest":
        return "tests"
    for marker, name in (("npm --prefix", "node-install"), ("grpcurl ", "grpcurl"),
                         ("vllm.entrypoints.openai.api_server", "vllm-server"),
                         ("curl -s localhost:8000", "vllm-curl")):
        if marker in body:
            return name
    return "commands"


def of_kind(name: str) -> list:
    found = [b for b in blocks() if kind(b) == name]
    assert found, f"README.md has no {name} block"
    return found


def the(name: str):
    (block,) = of_kind(name)
    return block


def section(title: str) -> str:
    """The README's text from the heading `## title` (any level) to the next heading of that level or above."""
    text = README.read_text()
    m = re.search(rf"^(#+) {re.escape(title)}\n", text, re.M)
    assert m, f"README.md has no heading {title!r}"
    rest = text[m.end():]
    end = re.search(rf"^#{{1,{len(m.group(1))}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


# ------------------------------------------------------------------------------------------------ the blocks


def test_every_block_is_claimed():
    found = blocks()
    assert len(found) >= 10, "README.md's fenced blocks were not found"
    unclaimed = [b.where() for b in found if kind(b) not in KINDS]
    assert not unclaimed, f"blocks no check of tests/test_readme.py runs (add one): {unclaimed}"
    for name in ("setup", "tests", "python-client", "node-install", "node-client", "grpcurl", "vllm-server",
                 "vllm-curl"):
        assert len(of_kind(name)) == 1, name


def test_the_quick_start_is_what_ci_runs():
    """.ci/run sets up with setup.sh and then runs exactly the README's test command; setup.sh ends with the demo."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == the("tests").text.strip(), f".ci/run's last command is {ci[-1]!r}"
    assert "bash setup.sh" in ci and the("setup").text.strip() == "./setup.sh"
    setup = ROOT / "setup.sh"
    assert setup.stat().st_mode & stat.S_IXUSR, "./setup.sh must be executable"
    lines = [line.strip() for line in setup.read_text().splitlines() if line.strip()]
    assert ".venv/bin/kvbridge demo" in lines, "setup.sh runs the main job, kvbridge demo"


def _parse(words: list[str]) -> None:
    """Parse a README command line with the command's own argparse parser: flags and subcommands exist."""
    from kvbridge.adapters.cli import build_parser as train_parser
    from kvbridge.cli import build_parser

    program, args = words[0], words[1:]
    if program == ".venv/bin/torchrun":  # torchrun's own options, then -m MODULE and the module's arguments
        module = args.index("-m")
        assert args[module + 1] == "kvbridge.adapters.cli", f"README runs {args[module + 1]} under torchrun"
        program, args = ".venv/bin/train-adapter", args[module + 2:]
    if program in (".venv/bin/kvbridge", ".venv/bin/train-adapter"):
        parser = build_parser() if program.endswith("kvbridge") else train_parser()
        try:
            parser.parse_args(args)
        except SystemExit as exc:
            pytest.fail(f"README command {' '.join(words)!r} does not parse (exit {exc.code})")
    elif program == "bash":
        script = ROOT / args[0]
        assert script.is_file(), f"README runs {args[0]}, which is not in the repository"
        subprocess.run(["bash", "-n", str(script)], check=True)
    elif program == "./setup.sh":
        assert (ROOT / "setup.sh").is_file()
    else:
        pytest.fail(f"README command {' '.join(words)!r}: tests/test_readme.py does not know {program!r}")


def test_every_command_parses(capsys):
    checked = []
    for block in of_kind("commands"):
        for _, words in shell_commands(block.text):
            _parse(words)
            checked.append(" ".join(words))
    capsys.readouterr()
    for needed in ("kvbridge serve --preset small", "kvbridge data build --out data --install",
                   "kvbridge serve --preset production", "kvbridge demo --engine vllm"):
        assert any(needed in c for c in checked), f"README has no command {needed!r}"
    assert set(CHEAP) <= set(checked), "the cheap commands this test runs are in README.md as written"


@pytest.mark.parametrize("command", sorted(CHEAP))
def test_cheap_commands_run(command):
    proc = subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True, timeout=300)
    # models info exits 1 when the production weights are not on the machine (here), after its figures
    assert proc.returncode == 0 or (proc.returncode == 1 and "weights: not on this machine" in proc.stdout), \
        proc.stdout[-2000:] + proc.stderr[-2000:]
    assert CHEAP[command] in proc.stdout, proc.stdout[-3000:]


def test_training_and_evaluation_name_data_a_clone_can_have():
    """The data commands read what `kvbridge data build --out data` writes (transfer/corpus.py's file names), and
    nothing of the README points outside the repository."""
    from kvbridge.transfer.corpus import OUTPUTS

    text = README.read_text()
    assert "../shared" not in text and "DESIGN.md" not in text
    named = set(re.findall(r"(?<![\w/.])data/([\w.]+)", text))
    assert named and named <= set(OUTPUTS), f"README names data files that data build does not write: {named}"
    assert not re.findall(r"\]\((?:https?:|/)", text), "README links only inside the repository"


# ------------------------------------------------------------------------------------------------ the clients


@pytest.fixture(scope="module")
def small_server(gemma, smollm2, tmp_path_factory):
    """The small pair in-process, open, with the shipped adapter and `kvbridge serve`'s correction (blend:0.1)."""
    import served

    running = served.start(gemma, [smollm2], tmp_path_factory.mktemp("no-adapters"), tokens=None, preset="small",
                           store_capacity_mb=512, max_message_mb=8, chunk_kb=1024, correction="blend:0.1",
                           selfcheck=False, store_device="cpu")
    yield running
    running.stop(1)


@pytest.mark.slow
def test_python_client_runs_against_the_small_pair(small_server):
    from kvbridge.server.client import KVBridgeClient

    run = subprocess.run([sys.executable, "-c", python_client()], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env={**os.environ, "KVBRIDGE_ADDRESS": small_server.address})
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    m = re.fullmatch(r"(\d+) source tokens -> (\d+) projected target tokens", lines[0])
    assert m and int(m.group(1)) > 20 and int(m.group(2)) > 20, run.stdout
    assert len(lines) >= 2 and lines[1].strip(), run.stdout  # SmolLM2 said something after the projected context
    with KVBridgeClient(small_server.address) as client:  # the server computed and stored the default correction
        assert client.stats().tenant_entries >= 3  # the source entry, its projection, the blend:0.1 correction


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory):
    """The README's install block run as it stands into a fresh folder (with client.js saved there first)."""
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node and npm are not on the PATH: the README's Node.js client needs them")
    folder = tmp_path_factory.mktemp("node")
    (folder / "client.js").write_text(the("node-client").text)
    install = the("node-install").text
    assert 'node "$NODE_DIR/client.js"' in install
    script = install.split('node "$NODE_DIR/client.js"')[0]  # the client runs in the tests, against their servers
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "NODE_DIR": str(folder)})
    output = proc.stdout + proc.stderr
    if proc.returncode and any(e in output for e in NETWORK_ERRORS):
        said = [line for line in output.splitlines() if line.startswith(("npm error code", "npm ERR! code"))]
        pytest.skip(f"the npm registry cannot be reached from here ({'; '.join(said) or output[-300:]})")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (folder / "kvbridge.proto").read_text() == (ROOT / "proto/kvbridge/v1/kvbridge.proto").read_text()
    return folder


@pytest.fixture(scope="module")
def tiny_server(tiny_source, tiny_target, adapters_dir):
    """The tiny pair in-process with bearer tokens (tenants alice and bob), this module's own."""
    import served

    running = served.start(tiny_source, [tiny_target], adapters_dir)
    yield running
    running.stop(1)


def test_node_client_lists_checks_ingests_and_reads_a_header(node_dir, tiny_server, tiny_target):
    """client.js against a server with tokens: reflection and health open, the kvbridge calls as tenant alice."""
    import grpc
    import served
    from kvbridge.server.client import KVBridgeClient

    server = tiny_server
    env = {**os.environ, "KVBRIDGE_ADDRESS": server.address, "KVBRIDGE_TOKEN": served.ALICE}
    proc = subprocess.run(["node", str(node_dir / "client.js")], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.strip().splitlines())
    assert lines["services"] == "grpc.health.v1.Health, grpc.reflection.v1alpha.ServerReflection, kvbridge.v1.KVBridge"
    assert lines["health"] == "SERVING"
    assert lines["models"] == "tiny-qwen2 (source), tiny-phi3 (target)"
    key, tokens = re.fullmatch(r"entry (\w+), (\d+) source tokens", lines["ingest"]).groups()
    with KVBridgeClient(server.address, token=served.ALICE) as alice:  # the entry is alice's: the token went along
        fetched = alice.fetch_projected(key=key)
    kv = fetched.segment.kv  # [L, 2, H_kv, T, D]
    spec, dtype = tiny_target.spec, str(kv.dtype).removeprefix("torch.")
    assert (kv.shape[0], kv.shape[2], kv.shape[4]) == (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    assert lines["projected"].startswith(
        f"tiny-phi3 {dtype} [{kv.shape[0]} layers, 2, {kv.shape[2]} heads, {kv.shape[3]} tokens, {kv.shape[4]}], "
        f"mode {fetched.mode}, "), lines["projected"]
    assert lines["projected"].endswith(f"adapter {fetched.adapter}") and int(tokens) > 0, lines["projected"]
    with KVBridgeClient(server.address, token=served.BOB, retries=0) as bob:  # not in another tenant's namespace
        assert served.code(lambda: bob.fetch_projected(key=key))[0] == grpc.StatusCode.NOT_FOUND


def test_node_client_says_what_failed(node_dir, tiny_server):
    """Without the token the kvbridge calls are refused: the client exits 1 with the server's sentence."""
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_TOKEN"}
    proc = subprocess.run(["node", str(node_dir / "client.js"), tiny_server.address], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "health: SERVING" in proc.stdout  # health answers without a token
    assert proc.stderr.startswith("kvbridge: 16 UNAUTHENTICATED"), proc.stderr


def test_grpcurl_session(tiny_source, tiny_target, adapters_dir):
    import served

    missing = [tool for tool in ("grpcurl", "jq") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not on the PATH (grpcurl is not installable here): the README's grpcurl "
                    "session is marked untested")
    running = served.start(tiny_source, [tiny_target], adapters_dir, tokens=None)  # open, as the session expects
    try:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", the("grpcurl").text], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "KVBRIDGE_ADDRESS": running.address})
    finally:
        running.stop(1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kvbridge.v1.KVBridge" in proc.stdout and "SERVING" in proc.stdout
    header = json.loads(proc.stdout.strip().splitlines()[-1])
    assert header["model"]["name"] == "tiny-phi3" and header["numLayers"] > 0


# ------------------------------------------------------------------------------------------------ vLLM


def test_vllm_server_command_is_the_connectors():
    """The OpenAI server's command line (run by hand; tests/test_vllm_openai.py starts the same server through
    OpenAIServer and runs the curl block): its connector config, environment and flags are kvbridge.vllm's."""
    from kvbridge.transfer.models import converted_path
    from kvbridge.vllm.engine import CPU_ENV, kv_transfer_config
    from kvbridge.vllm.openai_server import serve_command
    from kvbridge.vllm.params import ConnectorConfig

    words = shlex.split(the("vllm-server").text.replace("\\\n", " "))
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert env == CPU_ENV
    assert words[:3] == [".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(words[3::2], words[4::2]))
    known = set(serve_command("m", {}, 1)[3::2])
    assert set(flags) <= known, f"flags serve_command does not give: {set(flags) - known}"
    config = json.loads(flags["--kv-transfer-config"])
    expected = kv_transfer_config(address="127.0.0.1:50051")
    extra, expected_extra = config.pop("kv_connector_extra_config"), expected.pop("kv_connector_extra_config")
    assert config == expected
    assert ConnectorConfig.from_extra(extra) == ConnectorConfig.from_extra(expected_extra)
    assert Path(flags["--model"]) == converted_path("smollm2-135m-instruct-q4_1", Path("~/.cache/kvbridge"))
    curl = the("vllm-curl").text
    assert f"/models/{Path(flags['--model']).name}" in curl and "localhost:8000" in curl and flags["--port"] == "8000"


# ------------------------------------------------------------------------------------------------ the reference


def test_configuration_reference_names_every_flag_field_and_variable():
    from kvbridge.cli import build_parser

    reference = section("Configuration reference")
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {s for action in serve._actions for s in action.option_strings if s.startswith("--") and s != "--help"}
    missing = sorted(f for f in flags if f"`{f}" not in reference)
    assert not missing, f"serve flags missing from README's configuration reference: {missing}"
    fields = set(re.findall(r'"(kvbridge_[a-z_]+)"', (ROOT / "vllm_connector" / "params.py").read_text()))
    assert {"kvbridge_address", "kvbridge_mode", "kvbridge_servers"} <= fields
    missing = sorted(f for f in fields if f"`{f}`" not in reference)
    assert not missing, f"connector fields missing from README's configuration reference: {missing}"
    used = set()
    for folder in ("transfer", "adapters", "server", "eval", "vllm_connector", "cli", "bench", "experiments"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"KVBRIDGE_[A-Z0-9_]+", path.read_text()))
    for path in (ROOT / "setup.sh", ROOT / "setup-vllm.sh", ROOT / "tests" / "test_reliability.py"):
        used |= set(re.findall(r"KVBRIDGE_[A-Z0-9_]+", path.read_text()))
    missing = sorted(v for v in used if f"`{v}`" not in reference)
    assert not missing, f"environment variables missing from README's configuration reference: {missing}"


HEADING = re.compile(r"^#+ (.*)$", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("name", ["README.md", *NEW_DOCS])
def test_links_stay_inside_the_repository_and_resolve(name):
    path = ROOT / name
    text = path.read_text()
    assert "../shared" not in text
    for target in LINK.findall(text):
        assert not re.match(r"[a-z]+:", target) and not target.startswith("/"), f"{name}: a link outside: {target}"
        file, _, fragment = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists() and linked.is_relative_to(ROOT), f"{name}: {target} does not exist"
        if fragment:
            anchors = {anchor(h.replace("`", "")) for h in HEADING.findall(linked.read_text())}
            assert fragment in anchors, f"{name}: no heading for #{fragment} in {linked.relative_to(ROOT)}"
