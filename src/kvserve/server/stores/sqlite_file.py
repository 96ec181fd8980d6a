"""The server's SQLite file (keys, usage ledger, conversations): created private to its owner.

`connect(path)` makes the data folder 0700 when it creates it and the database file 0600 before
SQLite opens it; SQLite gives its -wal and -shm files the database file's mode. An existing file
that is readable by others is narrowed to 0600 (and a warning logged) on every start. An existing
file is never opened here: closing any descriptor of a file drops every POSIX lock this process
holds on it, and without its locks another process closing the file deletes the WAL that this
server's open connections still write to (their later writes lost).
"""

from __future__ import annotations

import logging
import os
import pathlib
import sqlite3
import stat

logger = logging.getLogger("kvserve.server")


def secure_file(path: pathlib.Path) -> None:
    """Create `path` (and its folder) private to this user, or narrow an existing one to 0600."""
    folder = path.parent
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)   # mkdir's mode is masked by the umask
    if not path.exists():
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        logger.warning("%s was readable by other users (mode %o); narrowing it to 0600", path, mode)
        os.chmod(path, 0o600)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists() and stat.S_IMODE(side.stat().st_mode) & 0o077:
            os.chmod(side, 0o600)


def connect(path: pathlib.Path | str, **kwargs) -> sqlite3.Connection:
    """sqlite3.connect on a file made private first (see secure_file)."""
    path = pathlib.Path(path)
    secure_file(path)
    return sqlite3.connect(path, **kwargs)
