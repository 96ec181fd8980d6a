"""`kvserve keys ...`: create, list and revoke API keys, set a key's moderation, show usage
(on the server's SQLite file, or the shared PostgreSQL/Redis stores)."""

from __future__ import annotations

import pathlib
from contextlib import closing

import typer

from kvserve.server.cli_common import DatabaseUrl, DataDir, RedisUrl, user_errors
from kvserve.server.settings import ServerSettings, default_data_dir
from kvserve.server.stores.common import DATABASE_SCHEMES, check_url
from kvserve.server.stores.factory import open_key_backend

keys_app = typer.Typer(help="Create, list and revoke API keys; show usage.", no_args_is_help=True)


def _store(data_dir: pathlib.Path | None, database_url: str | None = None, redis_url: str | None = None):
    """The key store the server uses: the SQLite file in the data dir, or --database-url (with
    --redis-url, the servers' key cache sees the change at once)."""
    with user_errors():
        return open_key_backend(ServerSettings(load_model=False, data_dir=data_dir or default_data_dir()).db_path,
                                database_url, redis_url)


def _run(store, method: str, *args, **kwargs):
    """One store call, the store closed after, a store error printed on one line (exit 1)."""
    with user_errors(), closing(store):
        return getattr(store, method)(*args, **kwargs)


@keys_app.command("create")
def keys_create(
    name: str = typer.Option(..., "--name", help="A name for the key (letters, digits, - _ .)."),
    rpm: int = typer.Option(None, "--rpm", help="Requests per minute (default: unlimited)."),
    tpm: int = typer.Option(None, "--tpm", help="Tokens per minute, prompt + max_tokens (default: unlimited)."),
    tier: str = typer.Option("paid", "--tier", help="paid or free (paid is served first under load)."),
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    redis_url: RedisUrl = None,
) -> None:
    """Create a key and print it. It is shown only this once: only its hash is stored."""
    key = _run(_store(data_dir, database_url, redis_url), "create", name, tier=tier, rpm=rpm, tpm=tpm)
    typer.echo(key)
    typer.echo(f"created key {name!r} (tier {tier}); store it now, it cannot be shown again", err=True)


@keys_app.command("list")
def keys_list(data_dir: DataDir = None, database_url: DatabaseUrl = None, redis_url: RedisUrl = None) -> None:
    """List keys (names, prefixes, limits; never the keys themselves)."""
    keys = _run(_store(data_dir, database_url, redis_url), "list")
    if not keys:
        typer.echo("no keys (the server is open until the first key is created)")
        return
    typer.echo(f"{'name':<20} {'prefix':<10} {'tier':<5} {'rpm':>7} {'tpm':>9}  status")
    for k in keys:
        status = "revoked" if k.revoked_at else "active"
        typer.echo(f"{k.name:<20} {k.prefix:<10} {k.tier:<5} {k.rpm or '-':>7} {k.tpm or '-':>9}  {status}")


@keys_app.command("revoke")
def keys_revoke(name: str = typer.Argument(..., help="The key's name."),
                data_dir: DataDir = None, database_url: DatabaseUrl = None, redis_url: RedisUrl = None) -> None:
    """Revoke a key; requests with it get 401 from then on."""
    if not _run(_store(data_dir, database_url, redis_url), "revoke", name):
        typer.echo(f"error: no active key named {name!r} (see `kvserve keys list`)", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {name!r}")


@keys_app.command("moderation")
def keys_moderation(
    subject: str = typer.Argument(None, help="A key's name or tier:free / tier:paid; none lists the policies."),
    mode: str = typer.Option(None, help="input,output | input | output | off."),
    threshold: list[str] = typer.Option(None, help="CATEGORY=SCORE that flags (e.g. violence=0.3). Repeatable."),  # noqa: B008
    block: list[str] = typer.Option(None, help="CATEGORY=PHRASE to block (a category of your own is fine). "  # noqa: B008
                                               "Repeatable."),
    regex: list[str] = typer.Option(None, help="CATEGORY=REGEX to block. Repeatable."),  # noqa: B008
    pii_input: str = typer.Option(None, help="off | flag | redact."),
    pii_output: str = typer.Option(None, help="off | redact."),
    check_every: int = typer.Option(None, help="Output: check a window every this many tokens."),
    action: str = typer.Option(None, help="block | annotate (verdicts logged and traced, nothing blocked)."),
    request_overrides: bool = typer.Option(None, "--request-overrides/--no-request-overrides",
                                           help="Whether a request's kvserve_moderation may set action and pii_output."),
    clear: bool = typer.Option(False, "--clear", help="Remove the subject's policy."),
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Set, show or clear the moderation policy of a key or tier (on top of `serve --moderation`)."""
    import json

    from kvserve.server.stores.moderation_policies import PolicyStore, policy_from_options

    with user_errors():   # with --database-url, the servers started with the same URL apply it within a second
        where = check_url(database_url, "--database-url", DATABASE_SCHEMES) if database_url else \
            ServerSettings(load_model=False, data_dir=data_dir or default_data_dir()).db_path
        store = PolicyStore(where)
    with user_errors(), closing(store):
        if subject is None:
            for name, policy in sorted(store.all().items()):
                typer.echo(f"{name:<20} {json.dumps(policy)}")
            return
        if clear:
            typer.echo(f"{'removed' if store.delete(subject) else 'no policy for'} {subject}")
            return
        policy = policy_from_options(mode, threshold, block, regex, pii_input, pii_output, check_every,
                                     action, request_overrides)
        store.set(subject, {**store.all().get(subject, {}), **policy})
        typer.echo(f"{subject}: {json.dumps(store.all()[subject])}")


@keys_app.command("usage")
def keys_usage(name: str = typer.Argument(None, help="Only this key."),
               data_dir: DataDir = None, database_url: DatabaseUrl = None, redis_url: RedisUrl = None) -> None:
    """Tokens used per key per day (UTC)."""
    rows = _run(_store(data_dir, database_url, redis_url), "usage", name)
    if not rows:
        typer.echo("no usage recorded")
        return
    typer.echo(f"{'day':<11} {'key':<20} {'requests':>8} {'prompt':>10} {'completion':>10} {'cached':>10}")
    for r in rows:
        typer.echo(f"{r['day']:<11} {r['key_name']:<20} {r['requests']:>8} {r['prompt_tokens']:>10} "
                   f"{r['completion_tokens']:>10} {r['cached_tokens']:>10}")
