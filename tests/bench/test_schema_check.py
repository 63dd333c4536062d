"""jaxpipe_bench/schema_check.py: `fits` agrees with pydantic's validation of the same model
(its JSON schema is what `fits` reads) on values that fit and on each way of not fitting, and
`check_schema` refuses what `fits` would not check, naming the place."""

from __future__ import annotations

from typing import Annotated

import pydantic
import pytest

from jaxpipe_bench.schema_check import check_schema, fits
from jaxpipe_bench.structured import SCHEMA


class Item(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    name: Annotated[str, pydantic.StringConstraints(min_length=1, max_length=5)]
    n: Annotated[int, pydantic.Field(ge=-3, le=10)]
    score: Annotated[float, pydantic.Field(gt=0, lt=1)]
    tags: Annotated[list[Annotated[str, pydantic.StringConstraints(max_length=2)]],
                    pydantic.Field(max_length=2)]
    flag: bool = False


GOOD = {"name": "abc", "n": 10, "score": 0.5, "tags": ["x", "yz"], "flag": True}
VALUES = [GOOD, {**GOOD, "flag": None}, {**GOOD, "flag": 1},
          {k: v for k, v in GOOD.items() if k != "flag"},
          {**GOOD, "name": ""}, {**GOOD, "name": "abcdef"}, {**GOOD, "n": 11},
          {**GOOD, "n": -4}, {**GOOD, "n": True}, {**GOOD, "n": "1"}, {**GOOD, "score": 1},
          {**GOOD, "score": 0.0}, {**GOOD, "tags": ["a", "b", "c"]}, {**GOOD, "tags": ["abc"]},
          {**GOOD, "tags": "ab"}, {**GOOD, "extra": 1}, {"name": "a", "n": 1, "score": 0.5},
          [GOOD], "text", None]


@pytest.mark.parametrize("value", VALUES)
def test_fits_agrees_with_pydantic(value):
    schema = Item.model_json_schema()
    check_schema(schema)
    try:
        Item.model_validate(value)
        expected = True
    except pydantic.ValidationError:
        expected = False
    assert fits(value, schema) is expected


def test_the_benchmark_schema_is_checked_and_an_example_fits():
    check_schema(SCHEMA)
    example = {"title": "T", "summary": "S", "language": "en", "year": 2024,
               "keywords": ["a", "b"]}
    assert fits(example, SCHEMA)
    assert not fits({**example, "year": 1800}, SCHEMA)


@pytest.mark.parametrize("schema, where", [
    ({"type": "string", "pattern": "a"}, r"schema: keyword\(s\) \['pattern'\]"),
    ({"properties": {"a": {"anyOf": []}}}, r"schema\.properties\.a: .*'anyOf'"),
    ({"type": "array", "items": {"type": "text"}}, r"schema\.items\.type: \['text'\]"),
    ({"additionalProperties": {"type": "string"}}, r"schema\.additionalProperties"),
    ([], "must be a JSON object"),
])
def test_a_keyword_it_cannot_check_is_refused(schema, where):
    with pytest.raises(ValueError, match=where):
        check_schema(schema)
