"""bench/load_test.py stops what it started when it is interrupted: its client processes (which otherwise wait for a
deadline that never comes, and the runner's exit joins them), the server and its folders."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LOAD_TEST = Path(__file__).resolve().parents[1] / "bench" / "load_test.py"


@pytest.mark.integration
def test_load_test_interrupted_during_the_load_exits_and_leaves_no_client_running(tmp_path):
    # its own session: whatever it leaves running can be found (and killed) by its process group
    proc = subprocess.Popen([sys.executable, str(LOAD_TEST), "--preset", "tiny", "--no-redis", "--clients", "2",
                             "--tenants", "1", "--seconds", "600", "--restart", "none"],
                            cwd=LOAD_TEST.parents[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    out = []
    try:
        for line in proc.stdout:  # the clients are running once the runner says they are ready
            out.append(line)
            if "client processes ready" in line:
                break
        else:
            pytest.fail("load_test ended before its clients were ready:\n" + "".join(out))
        time.sleep(1.0)  # into the load (the clients started calling)
        proc.send_signal(signal.SIGINT)  # Ctrl-C of the runner alone
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("load_test did not exit within 90 s of SIGINT: its client processes are still running")
        # nothing of its process group is left (its clients, the forkserver, the server): the forkserver exits
        # when it sees its parent gone, which may take a moment
        deadline = time.monotonic() + 30
        while True:
            left = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(proc.pid)], capture_output=True,
                                  text=True).stdout.splitlines()
            left = [line for line in left if line.split()[1][:1] != "Z"]  # zombies wait for init to reap them
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not left, "processes left in load_test's group:\n" + "\n".join(left)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        proc.stdout.close()


def test_load_test_refuses_a_json_path_it_could_not_write_before_the_run(tmp_path, capsys):
    sys.path.insert(0, str(LOAD_TEST.parent))
    import load_test

    # the report is written after the whole run: a path that cannot be written is refused before anything starts
    with pytest.raises(SystemExit) as exc:
        load_test.main(["--json", str(tmp_path / "no-such-folder" / "report.json"), "--clients", "1", "--seconds",
                        "1", "--no-redis", "--restart", "none"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--json" in err and "no-such-folder" in err, err
    with pytest.raises(SystemExit) as exc:
        load_test.main(["--adapter", str(tmp_path / "missing.safetensors"), "--clients", "1", "--seconds", "1",
                        "--no-redis", "--restart", "none"])
    assert exc.value.code == 2 and "--adapter" in capsys.readouterr().err
