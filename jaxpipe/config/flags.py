"""Command-line flags derived from a config dataclass: the one way every jaxpipe command line
(`python -m jaxpipe.serve`, `python -m jaxpipe.batch`, the scripts) gets its flags.

Each field becomes one flag: `max_num_seqs` -> `--max-num-seqs`; a bool field -> `--overlap` /
`--no-overlap`; a `Literal[...]` field takes one of its values; a `tuple[int, ...]` field takes
one or more values, spaced or comma-separated (`--stages 1 2 4`, `--hf-batch-sizes 8,16`), and
a `tuple[Literal[...], ...]` one or more of the literal's values; `X | None` takes an X. Fields
of other types (dicts, tuples of tuples) get no flag and keep their defaults. The help is the
field's entry in the class docstring ("    name, other: text", continued on lines indented
deeper), so the docstring a reader of the class sees is the help a user of the command sees,
and the default is the dataclass's. Four keys of a field's metadata shape its flag: `"flags"`,
names that replace `--field-name` (the first is the one help shows; `field(default=...,
metadata={"flags": ("--json",)})` for `json_path`); `"none_flag"`, an extra flag that sets the
field to None (ServerConfig.port's `--no-grpc`); `"positional"`, a positional argument instead
of a flag (required where the field has no default; a tuple field takes the remaining
arguments, each verbatim: they may be another command's flags); `"repeat"`, a tuple field's
flag given once per value, each verbatim, commas included (`--engine-field
quantization=none,int8 --engine-field dtype=float32`). Plain dict keys, so a config
module (the benchmarks') can use them without importing jaxpipe.

A flag reaches the config only when given (argparse.SUPPRESS), so the dataclass's own defaults
and `__post_init__` validation apply; a ValueError from it is the parser's usage error. A
command whose default differs from the class's (its own output path) says so in `add_flags`'s
`defaults`, which its help shows too.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing

_ENTRY = re.compile(r"^    ([a-z_]+(?:, [a-z_]+)*):(.*)$")
_NONE = type(None)


def field_docs(cls) -> dict[str, str]:
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


def add_flags(parser: argparse.ArgumentParser, cls, group: str | None = None,
              skip: typing.Iterable[str] = (),
              defaults: typing.Mapping[str, typing.Any] | None = None) -> None:
    """Add one flag per field of the dataclass `cls` (less `skip`) to `parser`, in an
    argument group named `group` (default: the class's name). `defaults` (field name ->
    value) replaces fields' defaults on this command line: in their help, and in the config
    whether their flags are given or not."""
    target = parser.add_argument_group(group or cls.__name__)
    docs, hints, fields = field_docs(cls), typing.get_type_hints(cls), flag_fields(cls, skip)
    defaults = dict(defaults or {})
    unknown = sorted(set(defaults) - {f.name for f in fields})
    if unknown:
        raise TypeError(f"add_flags({cls.__name__}): defaults for no flag: {unknown}")
    for field in fields:
        default = defaults.get(field.name, _default(field))
        kwargs = {"default": defaults.get(field.name, argparse.SUPPRESS),
                  "help": _help(docs.get(field.name, ""), default),
                  **_value_kwargs(_kind(hints[field.name]), field)}
        if field.metadata.get("positional"):
            target.add_argument(field.name, **kwargs)
            continue
        names, none = _names(field)
        target.add_argument(*names, dest=field.name, **kwargs)
        if none:
            target.add_argument(none, dest=field.name, action="store_const", const=None,
                                default=argparse.SUPPRESS,
                                help=f"{field.name} None (see {names[0]})")


def _value_kwargs(kind, field: dataclasses.Field) -> dict:
    """add_argument's arguments that take a value of `kind` (see `_kind`) for `field`."""
    if kind is bool:
        if field.metadata.get("positional"):
            raise TypeError(f"{field.name}: a bool field cannot be positional")
        return {"action": argparse.BooleanOptionalAction}
    item = kind[0] if isinstance(kind, list) else kind
    choices = "{" + ",".join(map(str, item)) + "}" if isinstance(item, tuple) else None
    if field.metadata.get("positional"):  # a value is taken verbatim, choices checked by type
        metavar = choices or field.name
        if isinstance(kind, list):  # the rest of the command line
            return {"action": _Items, "nargs": "*" if _has_default(field) else "+",
                    "type": _one(item), "metavar": metavar}
        nargs = {"nargs": "?"} if _has_default(field) else {}
        return {"type": _first(_one(item)), "metavar": metavar, **nargs}
    if isinstance(kind, list) and field.metadata.get("repeat"):
        return {"action": _Repeated, "type": _first(_one(item)),
                "metavar": choices or field.name.upper()}
    if isinstance(kind, list):
        return {"action": _Items, "nargs": "+", "type": _split(item),
                "metavar": choices or field.name.upper()}
    if isinstance(kind, tuple):
        return {"choices": kind, "type": type(kind[0])}
    return {"type": kind, "metavar": field.name.upper()}


def _has_default(field: dataclasses.Field) -> bool:
    return (field.default is not dataclasses.MISSING
            or field.default_factory is not dataclasses.MISSING)


def config_kwargs(cls, args: argparse.Namespace) -> dict:
    """The fields of `cls` whose flags were given, with their values."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if hasattr(args, f.name)}


def config_from_args(cls, args: argparse.Namespace, parser: argparse.ArgumentParser,
                     **fields):
    """`cls` built from the given flags (and `fields`), validated by the class; a value it
    refuses is `parser`'s usage error (exit 2, the class's message)."""
    try:
        return cls(**config_kwargs(cls, args), **fields)
    except (ValueError, TypeError) as e:
        parser.error(str(e))


def flag_fields(cls, skip: typing.Iterable[str] = ()) -> list[dataclasses.Field]:
    """The fields of `cls` that get a flag: all but `skip` and those of a type no flag can
    spell (see the module docstring)."""
    hints, skip = typing.get_type_hints(cls), set(skip)
    return [f for f in dataclasses.fields(cls)
            if f.name not in skip and _kind(hints[f.name]) is not None]


class _Items(argparse.Action):
    """One or more values, each possibly comma-separated, stored as one tuple."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, tuple(v for group in values for v in group))


class _Repeated(argparse.Action):
    """One value per occurrence of the flag, verbatim, gathered into one tuple."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (*getattr(namespace, self.dest, ()), values))


def _split(item):
    """Text -> the tuple of its comma-separated values, each of type `item` or, for a tuple
    `item` (a Literal's values), one of them."""
    one = _one(item)

    def parse(text: str) -> tuple:
        return tuple(v for part in text.split(",") if part.strip() for v in one(part.strip()))

    parse.__name__ = getattr(item, "__name__", "choice")  # argparse's "invalid int value"
    return parse


def _one(item):
    """Text -> a 1-tuple of one value of type `item` (or one of the values of a tuple `item`),
    taken verbatim."""

    def parse(text: str) -> tuple:
        if not isinstance(item, tuple):
            return (item(text),)
        value = type(item[0])(text)
        if value not in item:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(map(repr, item))})")
        return (value,)

    parse.__name__ = getattr(item, "__name__", "choice")
    return parse


def _first(parse_one):
    """`parse_one`'s value itself, not its 1-tuple; argparse.SUPPRESS passes through (argparse
    runs an absent optional positional's default, SUPPRESS, through the type)."""

    def parse(text: str):
        return text if text is argparse.SUPPRESS else parse_one(text)[0]

    parse.__name__ = parse_one.__name__
    return parse


def _kind(hint):
    """bool, int, float or str; a tuple of choices (Literal); [item type] for a tuple or
    list of scalars, [tuple of choices] for one of a Literal; None where no flag fits."""
    members = [t for t in (typing.get_args(hint) if _is_union(hint) else (hint,))
               if t is not _NONE]
    if len(members) != 1:  # `str | Layout`: given as text, parsed by the class
        return str if str in members else None
    hint = members[0]
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return typing.get_args(hint)
    if origin in (tuple, list):
        item = typing.get_args(hint)[0]
        if typing.get_origin(item) is typing.Literal:
            return [typing.get_args(item)]
        return [item] if item in (int, float, str) else None
    return hint if hint in (bool, int, float, str) else None


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _names(field: dataclasses.Field) -> tuple[tuple[str, ...], str | None]:
    names = field.metadata.get("flags") or ("--" + field.name.replace("_", "-"),)
    return tuple(names), field.metadata.get("none_flag")


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _help(doc: str, default) -> str:
    text = doc.replace("%", "%%")
    if default is None or default is dataclasses.MISSING:
        return text
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif isinstance(default, (tuple, list)):
        shown = ",".join(map(str, default)) or "none"
    else:
        shown = default
    return f"{text} (default: {shown})"
