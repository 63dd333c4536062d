"""scripts/code_report.py's figures on a small package written for the test: function lengths,
methods per class, imports inside functions, two-way pairs, cycles and upward imports."""

from __future__ import annotations

from jaxpipe_bench.code_report import ReportConfig, report


def write(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_report_counts_what_a_newcomer_meets(tmp_path):
    pkg = tmp_path / "pkg"
    write(pkg, {
        "__init__.py": 'LAYERS = (("low",), ("high",))\n',
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from pkg.high import b\n    return b\n",
        "high/__init__.py": "",
        "high/b.py": "from pkg.low import a\n\nclass C:\n    def m(self):\n        pass\n\n"
                     "    def n(self):\n        pass\n",
    })
    r = report(ReportConfig(root=str(pkg)))
    assert r["function_local_imports"] == 1 and r["function_local_imports_of_the_package"] == 1
    assert r["two_way_package_pairs"] == [("pkg.high", "pkg.low")]
    assert r["import_cycles"] == [["pkg.high", "pkg.low"]]
    assert r["upward_imports"] == ["pkg.low -> pkg.high"]
    assert r["largest_classes"][0] == {"class": "pkg.high.b.C", "methods": 2, "lines": 6}
    assert r["longest_functions"][0] == ("pkg.low.a.f", 3)
    assert r["root_modules"] == []
