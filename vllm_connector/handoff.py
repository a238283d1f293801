"""Fetched KV handed from the connector's scheduler side to its workers on the same host. The scheduler's message to
the workers carries only where the KV is and block ids, never the KV itself:
- a same-host server's own shared-memory segment (`SharedSegment`, a fetch with keep_shared): the worker maps it
  and checks it (`read`: path, mode, size, layout, checksum), no second copy; the scheduler releases it afterwards;
- else (a remote server, a streamed fetch) a safetensors file the scheduler staged in shared memory, mode 0600, an
  unguessable name, removed by the worker once read.

Files live in the engine's private folder, `<staging_dir>/kvbridge-stage-<uid>-<pid>` (0700; pid: the engine core
process that stages). An engine that is killed leaves its folder behind: the next engine to start on the host sweeps
the folders of this user whose process is gone (`sweep`), so nothing stays in /dev/shm past one restart.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Union

import torch
from kvbridge.server import shm_layout
from kvbridge.server.chunks import wire_dtype
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from kvbridge.server.replies import SharedSegment

log = logging.getLogger("kvbridge.vllm")
PREFIX = "kvbridge-stage-"
KVSource = Union[str, "SharedSegment"]  # a staged file's path, or the server's segment  # noqa: UP007


def private_folder(base: str | Path, pid: int | None = None) -> Path:
    """This process's staging folder under `base`, made 0700 (and checked to be ours and private when it exists)."""
    path = Path(base) / f"{PREFIX}{os.getuid()}-{pid or os.getpid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        info = path.lstat()
        if not path.is_dir() or path.is_symlink() or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(f"{path} exists and is not a private folder of this user") from None
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process with that pid: alive
        return True
    return True


def sweep(base: str | Path) -> list[Path]:
    """Remove this user's staging folders under `base` whose engine process is gone; the folders removed."""
    removed = []
    prefix = f"{PREFIX}{os.getuid()}-"
    for path in Path(base).glob(f"{prefix}*"):
        pid = path.name.removeprefix(prefix)
        if not pid.isdigit() or _alive(int(pid)) or path.is_symlink():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.warning("kvbridge: removed %d staging folder(s) of engines that are gone: %s", len(removed),
                    ", ".join(p.name for p in removed))
    return removed


def stage(kv: torch.Tensor, folder: str | Path) -> Path:
    """Write kv [L, 2, H_kv, T, D] to a fresh 0600 file in `folder`; its path."""
    # kv: [L, 2, H_kv, T, D]
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"staged KV must be [L, 2, H_kv, T, D], got {tuple(kv.shape)}")
    path = Path(folder) / f"kvbridge-{secrets.token_hex(16)}.safetensors"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # exists before any byte is written, as 0600
    os.close(fd)
    try:
        save_file({"kv": kv.detach().cpu().contiguous()}, str(path))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def take(path: str | Path) -> torch.Tensor:
    """Read a staged file and remove it: kv [L, 2, H_kv, T, D]."""
    try:
        return load_file(str(path))["kv"]
    finally:
        Path(path).unlink(missing_ok=True)


def discard(path: str | Path) -> None:
    Path(path).unlink(missing_ok=True)


def read(source: KVSource) -> torch.Tensor:
    """The KV a load writes, kv [L, 2, H_kv, T (+ headroom), D]: a staged file read and removed (`take`), or the
    server's segment mapped (copy-on-write, no copy) once its path, mode, size, layout and checksum check out."""
    if isinstance(source, str):
        return take(source)
    shm_layout.check_path(source.path, source.name)
    return shm_layout.map_kv(source.path, source.size, source.checksum, source.shape, wire_dtype(source.dtype))
