"""Serving: `python -m jaxpipe.serve`, a gRPC front end (jaxpipe.v1.Generation, health,
reflection) in its own process, talking to an engine process over ZeroMQ.

    jaxpipe.proto       the API; jaxpipe_pb2*.py are generated from it (scripts/gen_proto.py)
    config.py           ServerConfig
    cli.py              engine flags shared with `python -m jaxpipe.batch`
    server.py           the front-end process: gRPC server, health, reflection, drain
    service.py          the Generation service: validate, submit, stream results
    requests.py         request validation shared with batch jobs (RequestError names the field)
    protos.py           protobuf <-> Python values
    text.py             detokenization in the front end
    engine_client.py    the front end's side of the ZeroMQ link; spawns the engine process
    engine_process.py   the engine process: the device loop
    messages.py         the typed, versioned control messages between the two
"""
