"""Command-line flags for the engine, derived from `EngineConfig`: one flag per field
(`max_num_seqs` -> `--max-num-seqs`, a bool field -> `--overlap` / `--no-overlap`), its type from
the field's annotation and its help from the field's entry in EngineConfig's docstring. Shared by
`python -m jaxpipe.serve` and `python -m jaxpipe.batch`. A flag is passed on only when given,
so EngineConfig's own defaults and validation apply."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

from jaxpipe.config import EngineConfig

# Fields the front ends own under their own flags (batch: --no-progress).
NOT_FLAGS = frozenset({"show_progress"})
_ENTRY = re.compile(r"^    ([a-z_]+(?:, [a-z_]+)*):(.*)$")


def field_docs(cls=EngineConfig) -> dict[str, str]:
    """Each field's text in `cls`'s docstring ("    name, other: text" entries, continued
    on lines indented deeper), whitespace collapsed."""
    docs, names, text = {}, [], []
    for line in (cls.__doc__ or "").splitlines() + ["    end: ."]:
        match = _ENTRY.match(line)
        if match or not line.startswith("        "):
            for name in names:
                docs[name] = " ".join(text)
            names, text = [], []
        if match:
            names, text = match.group(1).split(", "), [match.group(2).strip()]
            text = [t for t in text if t]
        elif names:
            text.append(line.strip())
    return docs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineConfig field to `parser` (in an "engine" group)."""
    group = parser.add_argument_group("engine")
    docs, hints = field_docs(), typing.get_type_hints(EngineConfig)
    for field in _fields():
        flag = "--" + field.name.replace("_", "-")
        help_text = _help(docs.get(field.name, ""), _default(field))
        if hints[field.name] is bool:
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            group.add_argument(flag, dest=field.name, type=_scalar(hints[field.name]),
                               default=None, metavar=field.name.upper(), help=help_text)


def engine_kwargs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """EngineConfig fields from parsed flags (only those given); validated by EngineConfig."""
    kwargs = {f.name: getattr(args, f.name) for f in _fields()
              if getattr(args, f.name, None) is not None}
    try:
        EngineConfig(**kwargs)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    return kwargs


def _fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in NOT_FLAGS]


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _help(doc: str, default) -> str:
    text = doc.replace("%", "%%")
    if default is None:
        return text
    shown = ("on" if default else "off") if isinstance(default, bool) else default
    return f"{text} (default: {shown})"


def _scalar(hint) -> type:
    """int, float or str: the non-None member of an annotation such as `int | None`."""
    members = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    for kind in (int, float):
        if members and all(t is kind for t in members):
            return kind
    return str
