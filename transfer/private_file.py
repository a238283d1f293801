"""Files that hold secrets (the server's bearer tokens, the Redis tier's secret): read only when they are regular
files no user outside their owner and group can open."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_private_file(path: str | os.PathLike, what: str) -> bytes:
    """The file's bytes. ValueError naming `what` and the file when it does not exist, is not a regular file, or can
    be read or written by users other than its owner and group (mode bits for others set: `chmod 600`, or 640 for a
    group of its own)."""
    file = Path(path).expanduser()
    try:
        info = file.stat()
    except FileNotFoundError:
        raise ValueError(f"{what} {file} does not exist") from None
    except OSError as exc:
        raise ValueError(f"{what} {file} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {file} is not a regular file")
    if info.st_mode & 0o007:
        raise ValueError(f"{what} {file} is open to other users (mode {stat.S_IMODE(info.st_mode):04o}): "
                         f"chmod 600 {file} (or 640 for a group of its own)")
    try:
        return file.read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {file} cannot be read: {exc.strerror}") from None
