"""The config checks jaxpipe's CLIs and the tools share: a Literal field's values (None where
optional), counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from jaxpipe.config.checks import check_choices, check_counts


@dataclass
class Example:
    kind: Literal["a", "b", "c"] = "a"
    precision: Literal["bf16", "f32"] | None = None
    count: int = 1
    limit: int | None = None


@pytest.mark.parametrize("fields, message", [
    (dict(kind="d"), "Example.kind must be 'a', 'b' or 'c', got 'd'"),
    (dict(precision="u4"), "Example.precision must be 'bf16' or 'f32', got 'u4'"),
    (dict(count=0), "Example.count must be an integer >= 1, got 0"),
    (dict(count=None), "Example.count must be an integer >= 1, got None"),
    (dict(limit=1.5), "Example.limit must be an integer >= 1, got 1.5"),
    (dict(count=True), "Example.count must be an integer >= 1, got True"),
])
def test_a_bad_value_is_named_with_what_is_accepted(fields, message):
    config = Example(**fields)
    with pytest.raises(ValueError) as err:
        check_choices(config)
        check_counts(config, "count", "limit")
    assert str(err.value) == message


def test_good_values_and_an_optional_none_pass():
    for config in (Example(), Example(kind="c", precision="f32", count=3, limit=2)):
        check_choices(config)
        check_counts(config, "count", "limit")
