"""The throughput benchmark's peers, OpenVINO GenAI, HF transformers and llama.cpp
(llama-cpp-python), in an environment of their own.

The peers need pins the test environment cannot hold (optimum-intel 2.1.0 caps transformers
below 5.6, while the tests run against the release in `requirements/test.lock`), so they run
in `.venv-peers`, built from `requirements/peers.lock` by `make bench-env` or on the
benchmark's first use (`jaxpipe_bench.peers`), and talk to the benchmark through two files:

    .venv-peers/bin/python -m jaxpipe_peers JOB.json RESULT.json

JOB holds the peer's name, its model, the workload's requests (token ids and output length)
and its sweep; RESULT holds every sweep point, the best one and the peer environment's
library versions (`protocol`). Nothing here imports `jaxpipe`: the peers' environment has no
jax. `jaxpipe_bench` imports from here (the `Request` type and the throughput arithmetic are
defined once, in `protocol`).
"""
