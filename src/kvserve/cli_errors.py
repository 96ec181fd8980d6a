"""How a `kvserve` command reports an error its user can fix: one line `error: ...` on stderr and
exit status 1, never a traceback. Every command's body that can raise one runs under
`user_errors()`; typer is imported only when a command fails."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from kvserve.errors import KVServeError


def fail(message: str) -> NoReturn:
    """Print `error: message` on stderr and exit 1."""
    import typer

    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@contextmanager
def user_errors(os_error: Callable[[OSError], str] | None = None) -> Iterator[None]:
    """Inside: a KVServeError fails with its message; an OSError too, worded by `os_error` (a file
    the user named), when given (without it an OSError is a bug and propagates)."""
    try:
        yield
    except KVServeError as e:
        fail(e.message)
    except OSError as e:
        if os_error is None:
            raise
        fail(os_error(e))
