from pathlib import Path

from jaxpipe.config.cache_dir import cache_dir
from jaxpipe.config.engine import _default_cache_dir
from jaxpipe.runtime import kernel_choice


def test_xdg_cache_home_is_the_base(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "jaxpipe"
    assert cache_dir("timing") == tmp_path / "jaxpipe" / "timing"


def test_unset_or_empty_xdg_falls_back_to_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert cache_dir("kernels") == tmp_path / ".cache" / "jaxpipe" / "kernels"


def test_every_cache_of_the_package_is_under_it(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert Path(_default_cache_dir()) == tmp_path / "jaxpipe" / "xla"
    assert kernel_choice.cache_path().parent == tmp_path / "jaxpipe" / "kernel_choice"
