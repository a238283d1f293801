"""The server's private shared-memory folder: its `.lock`, the names in it, and removing the folders dead servers left.

The folder is made with a random name (`kvbridge-*`) and mode 0700 under the root (/dev/shm) and holds `.lock`,
flock-ed by the server while it lives; `remove_stale_folders` removes the folders of servers that died without closing
(their `.lock` is free), and no other.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("kvbridge.server.shm_segments")  # the segments' one logger

FOLDER_PREFIX = "kvbridge-"
LOCK_NAME = ".lock"
SPARE_PREFIX = "spare-"  # files being made or filled: never named to a client (no .safetensors)
KEPT_PREFIX = "kept-"  # kept files' private names (no .safetensors): clients get other names linked to them


def hold_lock(folder: Path) -> int:
    """Create folder/.lock already locked (made under another name, locked, then renamed: a folder whose `.lock`
    exists is never taken for a dead server's); the open descriptor, held for the server's life."""
    making = folder / f"{LOCK_NAME}.new"
    fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(making, folder / LOCK_NAME)
    return fd


def remove_stale_folders(root: str | Path) -> list[Path]:
    """Remove the segment folders under root left by servers that died without closing (their `.lock` is free);
    the folders removed. Files and folders without a `.lock` (another program's, or a server still starting) are
    left alone."""
    removed = []
    for folder in Path(root).glob(f"{FOLDER_PREFIX}*"):
        lock = folder / LOCK_NAME
        try:
            if folder.is_symlink() or not folder.is_dir() or folder.stat().st_uid != os.geteuid():
                continue
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live server holds it
            os.close(fd)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)
        removed.append(folder)
    if removed:
        log.warning("removed %d shared-memory folder(s) left by a server that did not stop cleanly: %s", len(removed),
                    ", ".join(map(str, removed)))
    return removed
