"""The server's SQLite file (server/stores/sqlite_file.py): opening another store on it must not
drop the process's locks (closing any descriptor of a file drops all of a process's POSIX locks on
it), or another process that opens and closes the file takes it for unused and deletes the WAL
the server is still writing to: those writes are lost."""

from __future__ import annotations

import subprocess
import sys

from kvserve.server.stores.sqlite_file import connect


def test_a_reader_in_another_process_does_not_lose_the_servers_writes(tmp_path):
    db = tmp_path / "kvserve.db"
    server = connect(db, isolation_level=None)
    server.execute("PRAGMA journal_mode=WAL")
    server.execute("CREATE TABLE t (x INTEGER)")
    server.execute("INSERT INTO t VALUES (1)")
    connect(db).close()            # a second store of the same server opens the file
    reader = f"import sqlite3; c = sqlite3.connect({str(db)!r}); c.execute('PRAGMA journal_mode=WAL'); " \
             "c.execute('SELECT * FROM t').fetchall(); c.close()"
    subprocess.run([sys.executable, "-c", reader], check=True)
    server.execute("INSERT INTO t VALUES (2)")
    check = f"import sqlite3; print(sqlite3.connect({str(db)!r}).execute('SELECT COUNT(*) FROM t').fetchone()[0])"
    out = subprocess.run([sys.executable, "-c", check], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "2"
    server.close()
