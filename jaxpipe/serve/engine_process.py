"""The engine process: owns the `Engine` and runs its device loop, nothing else.

It talks to the front end only through two ZeroMQ sockets carrying `messages` (requests in,
per-step token deltas out), so request parsing, tokenization and network I/O never stall a step.
The loop is a short list of non-blocking steps (gLLM's shape):

    receive control messages (block briefly only when idle)
    run one engine step, if there is work
    send every new token of that step in one message

Started by the front end as `python -m jaxpipe.serve.engine_process`; it exits on `Shutdown`,
or at once when the front end (its parent) disappears (`lifeline`), even mid-step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys

import zmq

from jaxpipe.process import lifeline
from jaxpipe.request.outputs import token_delta
from jaxpipe.request.params import SamplingParams
from jaxpipe.serve import messages as m

log = logging.getLogger("jaxpipe.serve.engine")

IDLE_POLL_MS = 100


class EngineLoop:
    """Serve one `Engine` over a pair of sockets until told to stop."""

    def __init__(self, engine, inbox: zmq.Socket, outbox: zmq.Socket, programs=None):
        """`programs`: the process's `Programs` counter (None: not counted, reported as 0)."""
        self.engine, self.programs = engine, programs
        self.inbox, self.outbox = inbox, outbox
        self.sent: dict[str, int] = {}  # live sample key -> output tokens already sent
        self.requests: dict[str, str] = {}  # live sample key -> its request's id
        self.counts = {"finished": 0, "aborted": 0, "generated": 0}
        self.stopping = False

    def run(self) -> None:
        """Announce readiness, then loop until `Shutdown`."""
        self._send(self._ready())
        while not self.stopping:
            busy = self.engine.has_unfinished()
            self._receive(0 if busy else IDLE_POLL_MS)
            if self.engine.has_unfinished():
                self._step()
        for key in list(self.sent):
            self._abort(key)

    def _ready(self) -> m.Ready:
        e = self.engine
        programs = self._programs()
        return m.Ready(pid=os.getpid(), model=e.config.model, max_model_len=e.max_model_len,
                       vocab_size=e.model_config.vocab_size, max_num_seqs=e.max_num_seqs,
                       programs_compiled=programs["compiled"],
                       programs_loaded=programs["loaded"])

    def _programs(self) -> dict[str, int]:
        return self.programs.counts() if self.programs else {"compiled": 0, "loaded": 0}

    def _receive(self, timeout_ms: int) -> None:
        if not self.inbox.poll(timeout_ms):
            return
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(m.decode(data))
            except m.ProtocolError as e:
                log.error("dropped a control message: %s", e)

    def _handle(self, msg) -> None:
        if isinstance(msg, m.AddRequest):
            self._add(msg)
        elif isinstance(msg, m.Abort):
            self._abort(msg.request_id)
        elif isinstance(msg, m.QueryStats):
            self._send(self._stats())
        elif isinstance(msg, m.Shutdown):
            self.stopping = True
        else:
            log.error("unexpected control message %s", type(msg).__name__)

    def _add(self, msg: m.AddRequest) -> None:

        try:
            params = SamplingParams(**msg.params)
            keys = m.sample_keys(msg.request_id, params.n)
            if any(key in self.sent for key in keys):
                raise ValueError(f"request id {msg.request_id!r} is in use")
            self.engine.add_request(None, params, prompt_token_ids=msg.prompt_token_ids,
                                    request_id=msg.request_id)
        except (ValueError, TypeError) as e:
            self._send(m.Rejected(msg.request_id, str(e)))
            return
        for key in keys:
            self.sent[key], self.requests[key] = 0, msg.request_id

    def _abort(self, key: str) -> None:
        """Abort the request that sample `key` belongs to: every sample still running."""
        request_id = self.requests.get(key)
        if request_id is None:
            return  # already finished: its final delta is on its way
        self.engine.abort(request_id)
        self.engine.forget(request_id)
        keys = [k for k, rid in self.requests.items() if rid == request_id]
        for k in keys:
            del self.sent[k], self.requests[k]
        self.counts["aborted"] += 1
        self._send(m.Outputs([m.TokenDelta(k, [], None, "abort", None) for k in keys]))

    def _step(self) -> None:
        deltas = [self._delta(seq) for seq in self.engine.step() if _key(seq) in self.sent]
        if deltas:
            self._send(m.Outputs(deltas))

    def _delta(self, seq) -> m.TokenDelta:
        key = _key(seq)
        delta = dataclasses.replace(token_delta(seq, self.sent[key]), request_id=key)
        self.sent[key] += len(delta.token_ids)
        self.counts["generated"] += len(delta.token_ids)
        if seq.is_finished:
            request_id = self.requests.pop(key)
            del self.sent[key]
            self.engine.forget(request_id)  # once all its samples have finished
            self.counts["finished"] += request_id not in self.requests.values()
        return delta

    def _stats(self) -> m.Stats:
        engine = {k: v for k, v in self.engine.stats().items() if k != "host_timeline"}
        engine.update({f"programs_{k}": n for k, n in self._programs().items()})
        return m.Stats(unfinished_requests=len(set(self.requests.values())),
                       engine_has_unfinished=self.engine.has_unfinished(),
                       finished_requests=self.counts["finished"],
                       aborted_requests=self.counts["aborted"],
                       generated_tokens=self.counts["generated"], engine=engine)

    def _send(self, msg) -> None:
        self.outbox.send(m.encode(msg))


def _key(seq) -> str:
    """The key a sample's deltas travel under (`messages.sample_key`)."""
    return m.sample_key(seq.group_id, seq.index)


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m jaxpipe.serve.engine_process",
                                description="jaxpipe's engine process (started by jaxpipe.serve)")
    p.add_argument("--config", required=True, help="EngineConfig fields as a JSON object")
    p.add_argument("--inbox", required=True, help="ZeroMQ address to receive requests from")
    p.add_argument("--outbox", required=True, help="ZeroMQ address to send outputs to")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Build the engine, connect to the front end and serve until shutdown."""
    lifeline.die_with_parent()
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    # lazy: after die_with_parent: a child whose front end dies while jax loads must not linger
    from jaxpipe import Engine, EngineConfig
    from jaxpipe.serve.programs import Programs

    programs = Programs()  # before the engine compiles (or loads) anything
    engine = Engine(EngineConfig(**json.loads(args.config)))
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (inbox, outbox):
        sock.setsockopt(zmq.LINGER, 2000)
    inbox.connect(args.inbox)
    outbox.connect(args.outbox)
    try:
        EngineLoop(engine, inbox, outbox, programs).run()
    finally:
        inbox.close()
        outbox.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
