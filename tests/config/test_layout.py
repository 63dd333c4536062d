"""The layout text and its degrees (jaxpipe/config/layout.py)."""

import pytest

from jaxpipe.config.layout import Layout


def test_ep_is_an_axis_counted_in_the_device_product():
    layout = Layout.parse("ep=4,tp=2")
    assert (layout.pp, layout.tp, layout.ep, layout.dp) == (1, 2, 4, 1)
    assert layout.num_devices == 8
    assert Layout.parse(str(layout)) == layout


@pytest.mark.parametrize("text", ["ep=0,tp=2", "ep=2,ep=2", "experts=2", ""])
def test_bad_layout_text_names_the_value(text):
    with pytest.raises(ValueError, match="layout"):
        Layout.parse(text)


def test_device_count_mismatch_names_the_product():
    with pytest.raises(ValueError, match="pp\\*tp\\*ep\\*dp = 8"):
        Layout(tp=2, ep=4).check_devices(4)
