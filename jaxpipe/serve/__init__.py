"""Serving: `python -m jaxpipe.serve`, a gRPC front end (jaxpipe.v1.Generation, health,
reflection) and an OpenAI-compatible HTTP front end in one process, talking to an engine
process over ZeroMQ.

    __main__.py         `python -m jaxpipe.serve`: the command line
    config.py           ServerConfig
    server.py           the front-end process: gRPC server, HTTP server, health, drain
    service.py          the Generation service: validate, submit, stream results
    http.py             the OpenAI HTTP API (FastAPI + uvicorn): routes, admission, errors
    engine_calls.py     one call's requests in the engine (HTTP, gRPC, Batch API jobs): submit,
                        gather deltas, abort the unfinished; on the event loop or a thread
    openai_responses.py OpenAI's response, chunk, logprobs and error shapes
    batches.py          the Batch API's files and jobs under --batch-dir (resumable)
    http_batches.py     the Batch API's HTTP routes
    batch_runner.py     the Batch API's runner: a job's requests on this server's engine
    protos.py           protobuf <-> Python values
    engine_client.py    the front end's side of the ZeroMQ link; spawns the engine process
    engine_process.py   the engine process: the device loop
    programs.py         where the engine process's programs came from (compiled, or loaded
                        from the persistent compilation cache: they differ in memory)
    messages.py         the typed, versioned control messages between the two
    metrics.py          the Prometheus registry (its own port, or /metrics on the HTTP one)

The API is `jaxpipe/protocol/`'s (jaxpipe.proto and its generated code). Shared with batch
jobs and the engine (the request side, `jaxpipe/request/`): validation
(validate.py), OpenAI bodies (openai.py), stop strings and detokenization (stopping.py), and a
sequence's deltas folded into its output (outputs.py: token_delta, Completion).
"""
