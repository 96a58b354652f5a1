"""Typed configuration: one dataclass per service, each field one flag and one environment variable.

Every setting is declared once, with `setting(...)`: its type, default, environment variable and help text.
`click_options()` turns a config class into CLI flags (so `--help` documents flags *and* env vars), and
`from_env()` builds one from the environment alone (tests, embedded use). Precedence: flag > env var > default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, TypeVar, get_type_hints

import click

T = TypeVar("T")
C = TypeVar("C")


class SettingError(ValueError):
    """A setting's value is unusable (raised by a config class's `__post_init__`); the CLI reports it as a
    one-line usage error naming the flag and the environment variable."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def setting(
    default: Any, env: str, help: str, *, flag: str | None = None, secret: bool = False, repeatable: bool = False
) -> Any:
    """Declare a config field. `flag` defaults to --field-name; `secret` hides the value in logs and --help;
    `repeatable` (list fields): the flag may be given several times, each value comma-separated too."""
    meta = {"env": env, "help": help, "flag": flag, "secret": secret, "repeatable": repeatable}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _flag_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _parse(kind: Any, raw: str) -> Any:
    if kind is bool:
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    if kind is int:
        return int(raw)
    if kind is float:
        return float(raw)
    if kind == list[str]:
        return [p.strip() for p in raw.split(",") if p.strip()]
    return raw


def fields_of(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    """The declared settings of a config class with their resolved types."""
    hints = get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if "env" in f.metadata]


def from_env(cls: type[C], environ: dict[str, str] | None = None, **overrides: Any) -> C:
    """Build a config from environment variables (then `overrides`), ignoring the command line."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for f, kind in fields_of(cls):
        if f.metadata["env"] in environ:
            values[f.name] = _parse(kind, environ[f.metadata["env"]])
    values.update(overrides)
    return cls(**values)


def env_vars(cls: type) -> dict[str, str]:
    """Map of environment variable -> field name (for docs and the compose/CLI consistency test)."""
    return {f.metadata["env"]: f.name for f, _ in fields_of(cls)}


def flags(cls: type) -> dict[str, str]:
    """Map of CLI flag -> field name."""
    return {_flag_name(f): f.name for f, _ in fields_of(cls)}


def click_options(cls: type[C]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding one click option per setting; the command receives `config=cls(...)`."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(**kwargs: Any) -> Any:
            names = {f.name: f for f, _ in fields_of(cls)}
            try:
                config = cls(**{k: v for k, v in kwargs.items() if k in names and v is not None})
            except SettingError as exc:
                f = names.get(exc.field)
                hint = f"'{_flag_name(f)}' / {f.metadata['env']}" if f is not None else None
                raise click.BadParameter(str(exc), param_hint=hint) from None
            rest = {k: v for k, v in kwargs.items() if k not in names}
            return fn(config=config, **rest)

        wrapper.__name__ = fn.__name__
        wrapper.__doc__ = fn.__doc__
        cmd: Callable[..., Any] = wrapper
        for f, kind in reversed(fields_of(cls)):
            default = (
                f.default
                if f.default is not dataclasses.MISSING
                else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            )
            shown = "(hidden)" if f.metadata["secret"] else default
            help_text = f"{f.metadata['help']} [env: {f.metadata['env']}; default: {shown}]"
            if kind is bool:
                opt = click.option(
                    f"{_flag_name(f)}/--no-{_flag_name(f)[2:]}",
                    f.name,
                    default=None,
                    envvar=f.metadata["env"],
                    help=help_text,
                    show_envvar=False,
                )
            elif kind == list[str] and f.metadata.get("repeatable"):
                opt = click.option(
                    _flag_name(f),
                    f.name,
                    multiple=True,
                    type=_CommaSeparated(),
                    envvar=f.metadata["env"],
                    help=help_text + " (repeatable, or comma-separated)",
                    callback=lambda _c, _p, v: [item for value in v for item in _parse(list[str], value)] or None,
                )
            elif kind == list[str]:
                opt = click.option(
                    _flag_name(f),
                    f.name,
                    default=None,
                    envvar=f.metadata["env"],
                    help=help_text + " (comma-separated)",
                    callback=lambda _c, _p, v: None if v is None else _parse(list[str], v),
                )
            else:
                click_type = {int: int, float: float}.get(kind, str)
                opt = click.option(
                    _flag_name(f), f.name, type=click_type, default=None, envvar=f.metadata["env"], help=help_text
                )
            cmd = opt(cmd)
        return cmd

    return decorate


class _CommaSeparated(click.ParamType):
    """A repeatable flag's values; its environment variable is one comma-separated value."""

    name = "text"
    envvar_list_splitter = ","


def redacted(config: Any) -> dict[str, Any]:
    """The config as a dict with secrets replaced, for start-up logs."""
    out: dict[str, Any] = {}
    for f, _ in fields_of(type(config)):
        value = getattr(config, f.name)
        out[f.name] = ("***" if value else "") if f.metadata["secret"] else value
    return out


def split_host_port(address: str) -> tuple[str, int]:
    """'127.0.0.1:50051' / '[::1]:50051' / 'localhost:0' -> (host, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise click.BadParameter(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """True for addresses that cannot be reached from another machine."""
    return host in {"localhost", "::1"} or host.startswith("127.")
