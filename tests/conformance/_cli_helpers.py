"""What the CLI tests share: the one-line error rule (dsv4-conformance prints errors as one line)."""
from __future__ import annotations


def one_line_error(capsys, *words: str) -> str:
    """stderr of the last CLI call: one line starting ``dsv4-conformance: ``, no traceback, every word in it."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("dsv4-conformance: "), err
    for word in words:
        assert word in err, (word, err)
    return err


def cli_registry(monkeypatch, *backends):
    """A registry of ``backends`` (plus the reference) that the CLI uses instead of the installed one."""
    from _wrong_backends import registry_of
    from dsv4.conformance import cli

    registry = registry_of(*backends)
    monkeypatch.setattr(cli, "_registry", lambda: registry)
    return registry
