"""cli_errors.user_errors: the one way a command reports an error its user can fix (issue 62 fold of
the `except KVServeError: echo; exit 1` blocks of the train, quantize and data commands)."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from kvserve.cli_errors import user_errors
from kvserve.errors import InvalidRequest


def _app(raise_: Exception, os_error=None) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    def run() -> None:
        with user_errors(os_error=os_error):
            raise raise_

    return app


def test_a_user_error_is_one_line_on_stderr_and_exit_1():
    r = CliRunner().invoke(_app(InvalidRequest("give --data FILE", param="data")), [])
    assert r.exit_code == 1
    assert r.stderr.strip() == "error: give --data FILE"
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_an_os_error_is_worded_by_the_command_when_it_names_a_file(tmp_path):
    missing = tmp_path / "nope.txt"
    try:
        missing.read_text()
    except OSError as e:
        err = e
    r = CliRunner().invoke(_app(err, os_error=lambda e: f"cannot read {missing}: {e.strerror}"), [])
    assert r.exit_code == 1
    assert r.stderr.strip() == f"error: cannot read {missing}: No such file or directory"


def test_an_os_error_the_command_did_not_expect_propagates():
    r = CliRunner().invoke(_app(PermissionError(13, "denied")), [])
    assert isinstance(r.exception, PermissionError)


def test_the_train_commands_use_it(tmp_path):
    from kvserve.train.cli import train_app

    r = CliRunner().invoke(train_app, ["cache-head", "--out", str(tmp_path / "missing" / "h.npz")])
    assert r.exit_code == 1 and r.stderr.startswith("error: cannot write")

