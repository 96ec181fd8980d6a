"""What the server's commands share: the data-dir and shared-store options, and user errors
printed on one line."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from kvserve.errors import KVServeError

DATA_DIR_HELP = "Directory for the keys/usage database (default $KVSERVE_DATA_DIR or ~/.kvserve)."
DataDir = Annotated[pathlib.Path | None, typer.Option(help=DATA_DIR_HELP)]
DatabaseUrl = Annotated[str | None, typer.Option(
    "--database-url", envvar="KVSERVE_DATABASE_URL",
    help="PostgreSQL for keys, usage and conversations, shared by several servers "
         "(postgresql://user:pass@host:5432/db; default: the SQLite file in --data-dir).")]
RedisUrl = Annotated[str | None, typer.Option(
    "--redis-url", envvar="KVSERVE_REDIS_URL",
    help="Redis for rate limits, the key-lookup cache and live counters, shared by several servers "
         "(redis://host:6379/0; default: this process's memory).")]


@contextmanager
def user_errors(exit_code: int = 1) -> Iterator[None]:
    """A KVServeError in the block printed as `error: <message>` on stderr, then exit `exit_code`
    (2: an option is wrong, before anything started; 1: the command failed)."""
    try:
        yield
    except KVServeError as e:
        typer.echo(f"error: {e.message}", err=True)
        raise typer.Exit(exit_code) from None
