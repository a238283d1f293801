"""tests/serveproc.py's ServeProcess on a real tiny `kvbridge serve`: an interrupt (Ctrl-C, or load_test.py's SIGTERM)
that lands while stop() waits for the server still leaves no server running, nor one that nobody reaps."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest

TOKEN = "stop-token-0123456789abcdef"


@pytest.mark.integration
def test_stop_interrupted_in_its_wait_kills_and_reaps_the_server(tmp_path, tiny_adapter_file, session_shm_dir,
                                                                 monkeypatch):
    from serveproc import ServeProcess

    (tmp_path / "tokens").write_text(f"stop {TOKEN}\n")
    (tmp_path / "tokens").chmod(0o600)  # a token file others can read is refused
    (tmp_path / "adapters").mkdir()
    shutil.copy(tiny_adapter_file, tmp_path / "adapters" / "tiny-pair.safetensors")
    serve = ServeProcess(tmp_path / "serve", [
        "--preset", "tiny", "--device", "cpu", "--store-device", "cpu", "--store-capacity-mb", "64",
        "--adapters", str(tmp_path / "adapters"), "--no-selfcheck", "--token-file", str(tmp_path / "tokens"),
        *(["--shm-dir", str(session_shm_dir)] if session_shm_dir else [])],
        env={"KVBRIDGE_HOME": str(tmp_path)}, start_timeout_s=240)
    serve.start()
    pid = serve.pid
    left = None
    try:
        # the first wait (for the drain after SIGTERM) is interrupted, as a KeyboardInterrupt raised by a signal
        # handler in there would be; the server itself is real and got its SIGTERM
        real_wait = subprocess.Popen.wait
        interrupted = []

        def wait_interrupted_once(self, timeout=None):
            if not interrupted:
                interrupted.append(timeout)
                raise KeyboardInterrupt
            return real_wait(self, timeout)

        monkeypatch.setattr(subprocess.Popen, "wait", wait_interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            serve.stop(timeout_s=60)
        assert interrupted == [60]
        # stop() killed and reaped it before the interrupt went on: no child of this process has that pid any more,
        # not even a zombie
        try:
            left = os.waitpid(pid, os.WNOHANG)  # (0, 0): still running; (pid, status): exited, reaped only now
        except ChildProcessError:
            pass
        assert left is None, (f"server {pid} {'still running' if left == (0, 0) else 'exited but unreaped'} after "
                              "the interrupted stop()")
        assert not serve.running and serve.pid is None
    finally:
        monkeypatch.undo()
        serve.kill()
        if left == (0, 0):  # our child, unreaped: its pid is still ours to kill
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
