"""The soak's gRPC calls (`jaxpipe_bench.soak`): streamed, batch, cancelled and malformed
`Generate` / `GenerateBatch` calls; grpc.health.v1 for health, GetServerInfo for the engine's
load.

Outcomes are the status code's name in lower case ("unavailable", "cancelled",
"invalid_argument"), or "ok"; a cancel whose stream ended before the cancel reached it is
"finished".
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from contextlib import AbstractContextManager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc

CANCEL_MAX_TOKENS = 64  # long enough that a cancel arrives mid-stream


class GrpcCalls:
    """Calls to the gRPC front end at `address`, checked into `tally`."""

    KINDS = ("stream", "batch", "cancel", "malformed")

    def __init__(self, address: str, tally, max_tokens: tuple[int, int], deadline: float):
        self.address, self.tally = address, tally
        self.max_tokens, self.deadline = max_tokens, deadline
        self._ids = itertools.count()

    def connect(self) -> AbstractContextManager:
        return _StubChannel(self.address)

    def call(self, kind: str, conn, rng: random.Random) -> str:
        return getattr(self, f"_{kind}")(conn.stub, rng)

    # ---- the server as a whole ----------------------------------------------------------------

    def serving(self) -> bool:
        with grpc.insecure_channel(self.address) as ch:
            try:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=5).status
            except grpc.RpcError:
                return False
        return status == health_pb2.HealthCheckResponse.SERVING

    def serves(self) -> bool:
        with grpc.insecure_channel(self.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            try:
                out = list(stub.Generate(pb.GenerateRequest(
                    text="Say hi.", sampling=pb.SamplingParams(temperature=0.0, max_tokens=2)),
                    timeout=self.deadline))
            except grpc.RpcError:
                return False
        return bool(out) and bool(out[-1].finish_reason)

    def prefix_cache(self) -> dict[str, float]:
        return {}  # GetServerInfo does not carry the cache's counters (/metrics does)

    def programs(self) -> dict[str, float]:
        return {}  # nor where the engine's programs came from

    def engine_load(self) -> dict[str, float]:
        with grpc.insecure_channel(self.address) as ch:
            info = pb_grpc.GenerationStub(ch).GetServerInfo(pb.ServerInfoRequest(), timeout=10)
        return {"unfinished_requests": info.unfinished_requests,
                "engine_has_unfinished": int(info.engine_has_unfinished)}

    # ---- the kinds ----------------------------------------------------------------------------

    def _sampling(self, rng: random.Random) -> pb.SamplingParams:
        lo, hi = self.max_tokens
        return pb.SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(lo, hi),
                                 seed=rng.randrange(1 << 30))

    def _prompt(self, rng: random.Random) -> str:
        return f"Request {next(self._ids)}: tell me about the number {rng.randrange(1000)}."

    def _stream(self, stub, rng) -> str:
        call = stub.Generate(pb.GenerateRequest(text=self._prompt(rng),
                                                sampling=self._sampling(rng)),
                             timeout=self.deadline)
        finals = 0
        try:
            for resp in call:
                if finals:
                    self.tally.violation("stream: a message after the final one")
                finals += bool(resp.finish_reason)
        except grpc.RpcError as e:
            return self._error("stream", e, (grpc.StatusCode.UNAVAILABLE,), finals)
        if finals != 1:
            self.tally.violation(f"stream: ended with {finals} final messages")
        return "ok"

    def _cancel(self, stub, rng) -> str:
        sampling = self._sampling(rng)
        sampling.max_tokens = CANCEL_MAX_TOKENS
        call = stub.Generate(pb.GenerateRequest(text=self._prompt(rng), sampling=sampling),
                             timeout=self.deadline)
        try:
            first = next(call)
            if first.finish_reason:
                return "finished"
            call.cancel()
            for _ in call:
                pass
        except grpc.RpcError as e:
            return self._error("cancel", e, (grpc.StatusCode.CANCELLED,
                                             grpc.StatusCode.UNAVAILABLE), 0)
        except StopIteration:
            self.tally.violation("cancel: a stream with no message")
            return "empty"
        return "finished"  # it ended before the cancel reached it

    def _malformed(self, stub, rng) -> str:
        bad = rng.choice([pb.SamplingParams(temperature=-1.0),
                          pb.SamplingParams(max_tokens=10**9), pb.SamplingParams(top_p=2.0)])
        try:
            for _ in stub.Generate(pb.GenerateRequest(text=self._prompt(rng), sampling=bad),
                                   timeout=self.deadline):
                pass
        except grpc.RpcError as e:
            return self._error("malformed", e, (grpc.StatusCode.INVALID_ARGUMENT,
                                                grpc.StatusCode.UNAVAILABLE), 0)
        self.tally.violation(f"malformed: {bad} was accepted")
        return "accepted"

    def _batch(self, stub, rng) -> str:
        n = rng.randint(2, 4)
        bad = rng.randrange(n) if rng.random() < 0.5 else None
        items = [pb.BatchItem(custom_id=f"c{i}", text=self._prompt(rng),
                              sampling=(pb.SamplingParams(temperature=-1.0) if i == bad
                                        else self._sampling(rng))) for i in range(n)]
        seen: Counter = Counter()
        try:
            for result in stub.GenerateBatch(pb.BatchRequest(items=items),
                                             timeout=self.deadline):
                seen[result.custom_id] += 1
                is_error = result.WhichOneof("result") == "error"
                want_error = result.custom_id == f"c{bad}"
                if is_error != want_error or (is_error and
                                              result.error.code != "INVALID_ARGUMENT"):
                    self.tally.violation(f"batch: item {result.custom_id} got {result}")
                self.tally.item("invalid" if is_error else "ok")
        except grpc.RpcError as e:
            for item in items:
                if not seen[item.custom_id]:
                    self.tally.item("unavailable")
            return self._error("batch", e, (grpc.StatusCode.UNAVAILABLE,), 0)
        finally:
            for cid, count in seen.items():
                if count != 1:
                    self.tally.violation(f"batch: {count} results for {cid}")
        missing = [i.custom_id for i in items if not seen[i.custom_id]]
        if missing:
            self.tally.violation(f"batch: no result for {missing}")
        return "ok"

    def _error(self, kind: str, error: grpc.RpcError, allowed, finals: int) -> str:
        code = error.code()
        if code not in allowed:
            self.tally.violation(f"{kind}: {code.name}: {error.details()}")
        if finals:
            self.tally.violation(f"{kind}: an error after the final message")
        return code.name.lower()


class _StubChannel:
    """A channel and its Generation stub for one client thread."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def __enter__(self) -> _StubChannel:
        return self

    def __exit__(self, *exc) -> None:
        self.channel.close()
