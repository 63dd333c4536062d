"""The front end <-> engine control messages: typed, versioned JSON; nothing else decodes."""

from __future__ import annotations

import json
import pickle

import pytest

from jaxpipe.serve import messages as m

EXAMPLES = [
    m.AddRequest("r1", [1, 2, 3], {"temperature": 0.0, "stop": ["\n"], "max_tokens": 4}),
    m.Abort("r1"),
    m.QueryStats(),
    m.Shutdown(),
    m.Ready(pid=7, model="smollm2-135m", max_model_len=256, vocab_size=49152, max_num_seqs=8),
    m.Ready(pid=8, model="smollm2-135m", max_model_len=256, vocab_size=49152, max_num_seqs=8,
            programs_compiled=3, programs_loaded=39),
    m.Outputs([m.TokenDelta("a", [5, 6], [[[5, -0.1], [9, -2.5]], [[6, -0.2]]]),
               m.TokenDelta("b", [], None, "stop", "\n"), m.TokenDelta("c", [2], None, "stop", 2)]),
    m.Rejected("r2", "prompt token ids [99999] are outside the vocabulary"),
    m.Stats(unfinished_requests=1, engine_has_unfinished=True, finished_requests=3,
            aborted_requests=1, generated_tokens=40),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip_is_exact(msg):
    assert m.decode(m.encode(msg)) == msg


def test_wire_format_is_versioned_json():
    raw = json.loads(m.encode(m.Abort("x")))
    assert raw == {"v": m.PROTOCOL_VERSION, "type": "Abort", "body": {"request_id": "x"}}


def _raw(kind: str, body: dict) -> bytes:
    """A message of this version as it would travel, `kind` and `body` as given."""
    return json.dumps({"v": m.PROTOCOL_VERSION, "type": kind, "body": body}).encode()


@pytest.mark.parametrize("data, match", [
    (json.dumps({"v": 99, "type": "Abort", "body": {"request_id": "x"}}).encode(), "version 99"),
    (_raw("Exec", {}), "unknown control message type"),
    (_raw("Abort", {"request_id": "x", "cmd": 1}), r"no fields \['cmd'\]"),
    (_raw("Abort", {}), "bad Abort message"),
    (pickle.dumps(m.Abort("x")), "not JSON"),
    (b"[1, 2]", "version None"),
])
def test_anything_else_is_refused(data, match):
    with pytest.raises(m.ProtocolError, match=match):
        m.decode(data)


def test_only_control_messages_encode():
    with pytest.raises(m.ProtocolError, match="not a control message"):
        m.encode({"type": "Abort"})
