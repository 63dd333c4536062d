"""The checks config dataclasses share in `__post_init__`, each error naming the class and
field: a `Literal` field holds one of its values, a count is an integer >= 1. Imports neither jax
nor numpy (nor does `import jaxpipe`, whose public names load lazily), so the tools' configs
(`jaxpipe_bench`) and the CLIs' (`PlanConfig`, `BatchJobConfig`) check without loading jax."""

from __future__ import annotations

import types
import typing


def check_choices(config) -> None:
    """Every field typed `Literal[...]` (or `Literal[...] | None`) holds one of its values."""
    for name, hint in typing.get_type_hints(type(config)).items():
        choices = _choices(hint)
        value = getattr(config, name)
        if choices and value not in choices:
            shown = [repr(c) for c in choices if c is not None]
            listed = ", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else shown[0]
            raise ValueError(f"{type(config).__name__}.{name} must be {listed}, got {value!r}")


def check_counts(config, *names: str) -> None:
    """Each field of `names` is an integer >= 1 (or None, where its type admits None)."""
    hints = typing.get_type_hints(type(config))
    for name in names:
        value = getattr(config, name)
        if value is None and type(None) in typing.get_args(hints[name]):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be an integer >= 1, "
                             f"got {value!r}")


def _choices(hint) -> tuple:
    """The values a `Literal` hint admits (None too where it is optional); () otherwise."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
        literals = [m for m in members if typing.get_origin(m) is typing.Literal]
        if literals and len(literals) + (type(None) in members) == len(members):
            return tuple(v for m in literals for v in typing.get_args(m)) + (
                (None,) if type(None) in members else ())
    return ()
