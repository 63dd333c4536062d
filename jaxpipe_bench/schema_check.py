"""Whether a JSON value fits a JSON schema, for the structured-outputs benchmark: a check
written against the schema, apart from the grammar engine that constrained the output (the
benchmark counts outputs that parse and fit; trusting the constraint to check itself would
count nothing). It covers the keywords an extraction schema uses:

  type (one name or a list), enum, const, properties, required, additionalProperties (a
  bool), minLength / maxLength, minimum / maximum / exclusiveMinimum / exclusiveMaximum,
  items, minItems / maxItems

and the annotations that constrain nothing (title, description, ...). `check_schema` refuses
any other keyword, so a schema given to the benchmark is checked fully or not run at all.
"""

from __future__ import annotations

import math
from typing import Any

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
_CHECKED = {"type", "enum", "const", "properties", "required", "additionalProperties",
            "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
            "exclusiveMaximum", "items", "minItems", "maxItems"}
_ANNOTATIONS = {"title", "description", "examples", "default", "$schema", "$id", "$comment"}


def check_schema(schema: Any, where: str = "schema") -> None:
    """ValueError naming the place in `schema` of a keyword `fits` does not check (or a
    schema that is no JSON object)."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON object (a schema), got {schema!r}")
    unknown = sorted(set(schema) - _CHECKED - _ANNOTATIONS)
    if unknown:
        raise ValueError(f"{where}: keyword(s) {unknown} are not checked by this benchmark; "
                         f"it checks {sorted(_CHECKED)}")
    types = schema.get("type", [])
    if bad := [t for t in ([types] if isinstance(types, str) else types)
               if t not in (*_TYPES, "integer", "number")]:
        raise ValueError(f"{where}.type: {bad} are no JSON types; use "
                         f"{sorted((*_TYPES, 'integer', 'number'))}")
    if not isinstance(schema.get("additionalProperties", False), bool):
        raise ValueError(f"{where}.additionalProperties must be true or false (a schema "
                         f"there is not checked)")
    for name, sub in schema.get("properties", {}).items():
        check_schema(sub, f"{where}.properties.{name}")
    if "items" in schema:
        check_schema(schema["items"], f"{where}.items")


def fits(value: Any, schema: dict) -> bool:
    """Whether the parsed JSON `value` fits `schema` (one `check_schema` accepts)."""
    if "type" in schema and not _has_type(value, schema["type"]):
        return False
    if "enum" in schema and not any(_equal(value, v) for v in schema["enum"]):
        return False
    if "const" in schema and not _equal(value, schema["const"]):
        return False
    if isinstance(value, dict):
        return _object_fits(value, schema)
    if isinstance(value, list):
        return _array_fits(value, schema)
    if isinstance(value, str):
        return schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", math.inf)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number_fits(value, schema)
    return True


def _has_type(value: Any, names: str | list[str]) -> bool:
    """JSON's types: a bool is no integer or number; 2.0 is an integer."""
    for name in [names] if isinstance(names, str) else names:
        if name in ("integer", "number"):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                    name == "number" or float(value).is_integer()):
                return True
        elif isinstance(value, _TYPES[name]):
            return True
    return False


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _object_fits(value: dict, schema: dict) -> bool:
    properties = schema.get("properties", {})
    if any(name not in value for name in schema.get("required", ())):
        return False
    if not schema.get("additionalProperties", True) and set(value) - set(properties):
        return False
    return all(fits(v, properties[k]) for k, v in value.items() if k in properties)


def _array_fits(value: list, schema: dict) -> bool:
    if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", math.inf):
        return False
    return "items" not in schema or all(fits(v, schema["items"]) for v in value)


def _number_fits(value: float, schema: dict) -> bool:
    return (schema.get("minimum", -math.inf) <= value <= schema.get("maximum", math.inf)
            and schema.get("exclusiveMinimum", -math.inf) < value
            < schema.get("exclusiveMaximum", math.inf))
