"""The same workload on one process of 8 devices (`cpu-8`) and on a cluster of 2 processes x 4
(jaxpipe.runtime.distributed, gloo on 127.0.0.1), with the leader's control channel per step.

Each run is a child process (`python -m jaxpipe_bench.multihost child ...`): JAX fixes a
process's devices and cluster when it starts. The leader child generates the workload twice
(the first run compiles) and writes the second run's figures as JSON. On one machine the
two-process run is slower (the "hosts" share its cores and talk over loopback TCP); the
figure that carries over to real hosts is the control overhead per step: the pickled bytes
the leader sends each follower and the milliseconds it spends sending them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jaxpipe.config.checks import check_choices, check_counts
from jaxpipe.config.engine import EngineConfig, Scheduler
from jaxpipe.config.model import Dtype
from jaxpipe_bench.workload import SEED, make_workload


@dataclass(frozen=True)
class MultihostConfig:
    """One workload and engine, run on one process and on two (`scripts/bench_multihost.py`'s
    flags).

    model: model preset or path
    num_prompts: requests in the workload
    input_len: fixed prompt length (none: ShareGPT-like lengths)
    output_len: tokens each request generates
    prefill, decode: the prefill / decode layout on cpu-8 (e.g. pp=2,tp=4)
    scheduler: EngineConfig.scheduler
    dtype: EngineConfig.dtype
    max_num_seqs: EngineConfig.max_num_seqs
    seed: seeds the workload
    json_path: where the results are written
    """

    model: str = EngineConfig.model
    num_prompts: int = 16
    input_len: int | None = None
    output_len: int = 32
    prefill: str = "pp=2,tp=4"
    decode: str = "tp=8"
    scheduler: Scheduler = "seesaw"
    dtype: Dtype = EngineConfig.dtype
    max_num_seqs: int = 16
    seed: int = SEED
    json_path: str = field(default="bench_multihost.json", metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_choices(self)
        check_counts(self, "num_prompts", "input_len", "output_len", "max_num_seqs")


def engine_kwargs(cfg: MultihostConfig) -> dict:
    return dict(model=cfg.model, mesh="cpu-8", prefill=cfg.prefill, decode=cfg.decode,
                scheduler=cfg.scheduler, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
                max_model_len=1024, show_progress=False)


def child(cfg: MultihostConfig, out: str | None, cluster: dict) -> None:
    """One process of a run: the leader (or the only process) times the workload; a
    follower follows."""
    from jaxpipe import Engine, EngineConfig, SamplingParams
    from jaxpipe.engine.builder import follow

    config = EngineConfig(**engine_kwargs(cfg), **cluster)
    if config.process_id:
        follow(config)
        return
    with Engine(config) as engine:
        workload = make_workload(cfg.num_prompts, cfg.seed, engine.model_config.vocab_size,
                                 cfg.input_len, cfg.output_len,
                                 engine.model_config.eos_token_ids)
        prompts = [list(r.prompt_token_ids) for r in workload]
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
                  for r in workload]
        engine.generate(prompt_token_ids=prompts, sampling_params=params)  # compiles
        engine.reset_stats()
        start = time.perf_counter()
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        stats = engine.stats()
    tokens = [o.outputs[0].token_ids for o in outs]
    Path(out).write_text(json.dumps({"seconds": seconds, "stats": stats, "tokens": tokens}))


def cluster_port() -> int:
    """A free port P with P+1 free too (JAX's coordinator and the control channel)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("found no two consecutive free ports")


def clean_env() -> dict:
    """This process's environment less JAX's cluster variables and XLA_FLAGS (a child sets
    its own devices and cluster)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}


def run(cfg: MultihostConfig, processes: int, workdir: Path, log=print) -> dict:
    """One run on `processes` processes; the leader's figures."""
    out = workdir / f"run{processes}.json"
    port = cluster_port()
    env = clean_env()
    procs = []
    for i in range(processes):
        cluster = {} if processes == 1 else {
            "coordinator": f"127.0.0.1:{port}", "num_processes": processes, "process_id": i}
        with open(workdir / f"run{processes}-{i}.log", "wb") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jaxpipe_bench.multihost", "child",
                 json.dumps(asdict(cfg)), str(out), json.dumps(cluster)],
                stdout=f, stderr=subprocess.STDOUT, env=env))
    try:
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if codes != [0] * processes:
        raise RuntimeError(f"the {processes}-process run failed (exit codes {codes}); logs in "
                           f"{workdir}")
    record = json.loads(out.read_text())
    log(f"[multihost] {processes} process(es): {record['seconds']:.1f} s")
    return record


def summary(record: dict) -> dict:
    s = record["stats"]
    steps = max(s["steps"], 1)
    return {"seconds": record["seconds"], "output_tok_s": s["generated_tokens"] / record["seconds"],
            "steps": s["steps"], "ms_per_step": record["seconds"] / steps * 1e3,
            "transitions": s["transitions"],
            "control_messages_per_step": s.get("control_messages", 0) / steps,
            "control_bytes_per_step": s.get("control_bytes", 0) / steps,
            "control_ms_per_step": s.get("control_seconds", 0.0) / steps * 1e3}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How alike two runs' tokens are: identical requests, and tokens equal up to each
    request's first difference (bf16 reductions in a different order can flip a near tie)."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = sum(next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
                 for x, y in zip(a, b, strict=True))
    return {"identical": same, "of": len(a), "prefix_tokens": prefix / max(1, sum(map(len, a)))}


def table(one: dict, two: dict, same: dict) -> str:
    rows = [("", "1 process x 8", "2 processes x 4")]
    for key, fmt in (("seconds", "{:.1f}"), ("output_tok_s", "{:.1f}"), ("steps", "{}"),
                     ("ms_per_step", "{:.1f}"), ("transitions", "{}"),
                     ("control_messages_per_step", "{:.2f}"),
                     ("control_bytes_per_step", "{:,.0f}"), ("control_ms_per_step", "{:.3f}")):
        rows.append((key, fmt.format(one[key]), fmt.format(two[key])))
    rows.append(("identical outputs", "", f"{same['identical']}/{same['of']} (tokens before the "
                 f"first difference: {same['prefix_tokens']:.0%})"))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) for r in rows)


def report(cfg: MultihostConfig, log: Callable[[str], None] = print) -> dict:
    """The workload on one process and on two: both runs' summaries and how alike their
    tokens are, logged as a table and written as JSON to `cfg.json_path`."""
    with tempfile.TemporaryDirectory(prefix="jaxpipe-multihost-") as tmp:
        one = run(cfg, 1, Path(tmp), log)
        two = run(cfg, 2, Path(tmp), log)
    same = agreement(one["tokens"], two["tokens"])
    rows = {"one": summary(one), "two": summary(two)}
    log(table(rows["one"], rows["two"], same))
    record = {"config": asdict(cfg), **rows, "same_tokens": same}
    Path(cfg.json_path).write_text(json.dumps(record, indent=2))
    return record


def main(argv=None) -> int:
    """`python -m jaxpipe_bench.multihost child CONFIG_JSON OUT CLUSTER_JSON`: one process of
    a run (`run` starts them; CLUSTER_JSON holds EngineConfig's cluster fields, {} for one)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 4 and argv[0] == "child":
        child(MultihostConfig(**json.loads(argv[1])), argv[2], json.loads(argv[3]))
        return 0
    raise SystemExit("run scripts/bench_multihost.py")

if __name__ == "__main__":
    sys.exit(main())
