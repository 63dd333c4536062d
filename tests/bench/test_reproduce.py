"""The reproductions' shared report: tables computed at the config's request count, logged in
order and written as JSON."""

from __future__ import annotations

import json

from jaxpipe_bench.reproduce import QUICK, ReproduceConfig, report_tables


def test_report_tables_logs_each_table_in_order_and_writes_the_rows(tmp_path):
    path = tmp_path / "out.json"
    config = ReproduceConfig(json_path=str(path), quick=True)
    lines = []
    tables = {"first": (lambda n: [n, 1], lambda rows: f"first {rows}"),
              "second": (lambda n: [n, 2], lambda rows: f"second {rows}")}
    results = report_tables(config, 8 * QUICK, tables, lines.append)
    assert results == {"num_requests": 8, "first": [8, 1], "second": [8, 2]}
    assert lines[:3] == ["first [8, 1]", "", "second [8, 2]"]
    assert json.loads(path.read_text()) == results


def test_report_tables_takes_num_requests_from_the_config():
    lines = []
    results = report_tables(ReproduceConfig(num_requests=5), 100,
                            {"rows": (lambda n: [n], str)}, lines.append)
    assert results == {"num_requests": 5, "rows": [5]} and lines == ["[5]"]
