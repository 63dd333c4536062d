"""Structured outputs' throughput (`scripts/bench_structured.py`): the same requests with
every one held to a JSON schema, against none, in one process, to see what the masks cost
(issue 50 asks for at least 0.8x the unconstrained output tok/s, and the engine thread's CPU
time per step with 256 constrained rows).

The workload is `bench_throughput.py`'s default shape (`workload.make_workload`: seeded
ShareGPT-like prompt and output lengths), each prompt's tokens put in the user turn of the
model's chat template behind an instruction to answer in JSON; max_tokens is the workload's
output length, and both kinds of request stop at EOS (a constrained one also once its JSON is
complete), so both are the same requests but for the constraint, and the table shows their
mean output lengths; `match_lengths` has each unconstrained request generate as many tokens
as its constrained twin instead, so that both kinds do the same work.

A constrained row's mask needs its previous token on the host, which overlap dispatches the
next step without: `EngineConfig.constrained_steps` "skip" has a constrained sequence sit out
the step after its own (the other rows keep overlapping) and "land" turns overlap off while
constrained requests run. An engine is built for each, one after the other (never both
alive), since the field cannot change on a built engine; each runs one untimed run of each
kind (they compile the masked sampler too), then `repeats` alternating pairs (unconstrained,
constrained), and each constrained median is compared with the unconstrained median of the
same engine. The prefix cache is off, so no run finds the prompts an earlier one left behind.

Per run: output tokens, wall seconds, output tok/s, mean output length, how many outputs parse
as JSON and fit the schema (`schema_check.fits`, a check apart from the grammar engine's),
engine steps, output tokens per step (each sampled row adds one: the mean sampled rows per
step), and the engine thread's CPU time per step: `Engine.generate` runs the loop on the
thread that calls it, so `time.thread_time()` around it is the scheduler, the step building,
the landing and the matchers' advance; the masks are filled on llguidance's own threads while
that thread waits, which the process's CPU time (also recorded) counts.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from jaxpipe.config.checks import check_choices, check_counts
from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.model import Dtype
from jaxpipe_bench.report import machine_info, write_json
from jaxpipe_bench.schema_check import check_schema, fits
from jaxpipe_bench.workload import NUM_PROMPTS, SEED, Request, describe_workload, make_workload

# An extraction-like object: short strings, a bounded integer, a short list of short strings.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 120},
        "language": {"type": "string", "maxLength": 16},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20},
                     "maxItems": 4},
    },
    "required": ["title", "summary", "language", "year", "keywords"],
    "additionalProperties": False,
}
KINDS = ("unconstrained", "json")  # a run's requests: free text, or each held to the schema
STEPS = ("skip", "land")  # EngineConfig.constrained_steps: one engine each
_MARK = "\ufffcPROMPT\ufffc"  # where the prompt's own tokens go in the rendered chat turn


@dataclass(frozen=True)
class StructuredBenchConfig:
    """What `scripts/bench_structured.py` runs (its flags).

    num_prompts: requests in the seeded workload (bench_throughput.py's default)
    seed: the workload's seed
    input_len: every prompt's own tokens (None: lognormal, ShareGPT-like)
    output_len: every request's max_tokens (None: lognormal, ShareGPT-like)
    temperature: of every request (0: greedy; above, each request seeded by its index, the
        same in every run)
    schema: a JSON schema file every constrained request is held to (None: SCHEMA, an
        extraction-like object); keywords jaxpipe_bench/schema_check.py cannot check are
        refused
    instruction: the text before each prompt's tokens in the chat template's user turn
    match_lengths: each unconstrained request generates exactly as many tokens as its
        constrained twin did in the first engine's untimed run (ignore_eos), so both kinds do
        the same work and the ratio is the constraint's cost alone (off: the same requests but
        for the constraint, each stopping at EOS, its complete JSON or max_tokens)
    repeats: timed pairs (unconstrained, constrained) per engine, after one untimed run of each
        (compiles)
    max_num_seqs: the engines' batch limit (with num_prompts well above it, e.g. 512, this
        many constrained sequences decode together; "skip" samples about half of them a step)
    model: model preset or path
    dtype: EngineConfig.dtype
    json_path: where the JSON goes
    """

    num_prompts: int = NUM_PROMPTS
    seed: int = SEED
    input_len: int | None = None
    output_len: int | None = None
    temperature: float = 0.0
    schema: str | None = None
    instruction: str = "Answer in JSON:\n"
    match_lengths: bool = False
    repeats: int = 3
    max_num_seqs: int = 256
    model: str = EngineConfig.model
    dtype: Dtype = EngineConfig.dtype
    json_path: str = "out/bench_structured.json"

    def __post_init__(self):
        check_counts(self, "num_prompts", "input_len", "output_len", "repeats", "max_num_seqs")
        check_choices(self)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature <= 2:
            raise ValueError(f"StructuredBenchConfig.temperature must be in [0, 2], got "
                             f"{self.temperature!r}")
        self.json_schema()  # a file that is missing, no JSON, or a schema not checked: refused

    def json_schema(self) -> dict:
        """The schema of the constrained requests: the file `schema`, else SCHEMA."""
        if self.schema is None:
            return SCHEMA
        where = f"StructuredBenchConfig.schema {self.schema!r}"
        try:
            schema = json.loads(Path(self.schema).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: cannot read a JSON schema from it: {e}") from None
        check_schema(schema, where)
        return schema


def run(config: StructuredBenchConfig) -> dict:
    """Both engines' runs; the record (JSON-able), also written to `config.json_path`."""
    machine, schema, (workload, prompts) = machine_info(), config.json_schema(), requests(config)
    params = {"json": sampling(config, workload, schema)}
    runs, texts = [], {}
    for steps in STEPS:
        engine = build(config, steps, max_model_len(workload, prompts))
        try:  # the untimed runs compile what the timed ones take (the masked sampler too)
            _, warm = timed(engine, prompts, params["json"], schema)
            lengths = [len(c.token_ids) for c in warm] if config.match_lengths else None
            params.setdefault("unconstrained", sampling(config, workload, None, lengths))
            timed(engine, prompts, params["unconstrained"], schema)
            for _ in range(config.repeats):
                for kind in KINDS:
                    result, done = timed(engine, prompts, params[kind], schema)
                    runs.append({"constrained_steps": steps, "kind": kind, **result})
                    texts[f"{steps}/{kind}"] = [c.text for c in done]
        finally:
            engine.close()
            gc.collect()  # the next engine's KV pool is sized from the free memory
    record = {"config": asdict(config), "machine": machine, "schema": schema,
              "workload": describe_workload(workload),
              "prompt_len": statistics.fmean(map(len, prompts)),
              "summary": summarise(runs), "runs": runs, "last_outputs": texts}
    write_json(record, config.json_path)
    return record


def requests(config: StructuredBenchConfig) -> tuple[list[Request], list[list[int]]]:
    """The seeded workload over the model's tokenizer (no special tokens in a prompt), and
    each prompt's token ids framed as a chat turn (`chat_frame`)."""
    from jaxpipe.model.loading import load_tokenizer
    from jaxpipe.model.presets import resolve_model

    tokenizer = load_tokenizer(resolve_model(config.model))
    if tokenizer is None:
        raise ValueError(f"model {config.model!r} has no tokenizer: structured outputs need one")
    backend = tokenizer.backend
    special = list(backend.get_added_tokens_decoder())
    workload = make_workload(config.num_prompts, config.seed,
                             backend.get_vocab_size(with_added_tokens=True), config.input_len,
                             config.output_len, special_ids=special)
    before, after = chat_frame(tokenizer, config.instruction)
    return workload, [before + list(r.prompt_token_ids) + after for r in workload]


def chat_frame(tokenizer, instruction: str) -> tuple[list[int], list[int]]:
    """The token ids before and after a prompt's own in the user turn of the model's chat
    template, `instruction` first (without a template: the instruction, and nothing)."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    if tokenizer.chat_template is None:
        return ids(instruction), []
    turn = tokenizer.apply_chat_template([{"role": "user", "content": instruction + _MARK}],
                                         add_generation_prompt=True)
    before, after = turn.split(_MARK)
    return ids(before), ids(after)


def sampling(config: StructuredBenchConfig, workload: Sequence[Request], schema: dict | None,
             lengths: Sequence[int] | None = None) -> list:
    """Each request's SamplingParams: max_tokens its output length, the config's
    temperature, seeded by its index, held to `schema` unless None; with `lengths`, request
    i generates exactly lengths[i] tokens instead (ignore_eos)."""
    from jaxpipe import SamplingParams

    so = None if schema is None else {"json": schema}
    return [SamplingParams(temperature=config.temperature, seed=i, structured_outputs=so,
                           max_tokens=max(lengths[i], 1) if lengths else r.output_len,
                           ignore_eos=lengths is not None) for i, r in enumerate(workload)]


def max_model_len(workload: Sequence[Request], prompts: Sequence[list[int]]) -> int:
    """The longest framed prompt plus its output, rounded up to 128."""
    longest = max(len(p) + r.output_len for p, r in zip(prompts, workload, strict=True))
    return -(-longest // 128) * 128


def build(config: StructuredBenchConfig, constrained_steps: str, model_len: int):
    """An engine with warm-up (it compiles every step shape), prefix cache off."""
    from jaxpipe import Engine

    return Engine(model=config.model, dtype=config.dtype, max_model_len=model_len,
                  max_num_seqs=config.max_num_seqs, prefix_caching=False, seed=config.seed,
                  constrained_steps=constrained_steps, show_progress=False)


def timed(engine, prompts: list[list[int]], params: list, schema: dict) -> tuple[dict, list]:
    """One `generate` of every prompt: its figures (the module docstring's) and the
    completions."""
    compiled = engine.stats()["compile_seconds"]
    engine.reset_stats()
    process, thread, start = time.process_time(), time.thread_time(), time.perf_counter()
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    wall = time.perf_counter() - start
    thread, process = time.thread_time() - thread, time.process_time() - process
    stats, done = engine.stats(), [o.outputs[0] for o in outs]
    tokens, steps = sum(len(c.token_ids) for c in done), max(stats["steps"], 1)
    return {"requests": len(done), "wall_s": wall, "output_tokens": tokens,
            "output_tok_s": tokens / wall, "mean_output_len": tokens / len(done),
            "finish_reasons": dict(Counter(c.finish_reason for c in done)),
            "stopped": sum(c.finish_reason == "stop" for c in done),
            "fit_schema": sum(parses(c.text, schema) for c in done),
            "steps": stats["steps"], "rows_per_step": tokens / steps,
            "mean_decode_batch": stats["mean_decode_batch"], "fed_steps": stats["fed_steps"],
            "engine_thread_cpu_s": thread, "cpu_ms_per_step": 1000 * thread / steps,
            "process_cpu_s": process, "host_ms_per_step": stats["host_ms_per_step"],
            "compile_s": stats["compile_seconds"] - compiled}, done


def parses(text: str, schema: dict) -> bool:
    """Whether `text` is one JSON value that fits `schema`."""
    try:
        return fits(json.loads(text), schema)
    except ValueError:
        return False


def summarise(runs: list[dict]) -> list[dict]:
    """Per engine and kind: the medians over its timed runs, output tok/s over the same
    engine's unconstrained median, and the shares of outputs that stopped before max_tokens
    and that fit the schema."""
    rows = []
    for steps in STEPS:
        mine = {k: [r for r in runs if (r["constrained_steps"], r["kind"]) == (steps, k)]
                for k in KINDS}
        base = statistics.median(r["output_tok_s"] for r in mine["unconstrained"])
        for kind, rs in mine.items():
            tok_s = statistics.median(r["output_tok_s"] for r in rs)
            rows.append({
                "constrained_steps": steps, "kind": kind, "median_output_tok_s": tok_s,
                "ratio": tok_s / base, **{k: statistics.median(r[k] for r in rs) for k in (
                    "cpu_ms_per_step", "rows_per_step", "mean_output_len", "wall_s")},
                **{f"{k}_rate": sum(r[k] for r in rs) / sum(r["requests"] for r in rs)
                   for k in ("stopped", "fit_schema")}})
    return rows


def format_record(record: dict) -> str:
    """The table: per engine and kind, the medians, the ratio to unconstrained, the shares
    of outputs that stopped before max_tokens (EOS, or their JSON complete) and that fit the
    schema."""
    c, m, w = record["config"], record["machine"], record["workload"]
    head = f"{'steps':>5} {'requests':>13} {'out tok/s':>10} {'ratio':>6} {'CPU ms/step':>12} " \
           f"{'rows/step':>10} {'mean len':>9} {'stopped':>8} {'fit schema':>11}"
    lines = [
        f"CPU: {m['cpu_model']} x {m['cpu_count']} ({', '.join(m['isa'])}; load "
        f"{m['loadavg_at_start'][0]:.1f} at start)",
        f"{w['num_requests']} prompts (seed {c['seed']}; {record['prompt_len']:.0f} tokens mean "
        f"with the chat frame), max_tokens median {w['output_len']['median']}, temperature "
        f"{c['temperature']}, {c['dtype']}, max_num_seqs {c['max_num_seqs']}, medians of "
        f"{c['repeats']} runs",
        head, "-" * len(head)]
    for r in record["summary"]:
        lines.append(
            f"{r['constrained_steps']:>5} {r['kind']:>13} {r['median_output_tok_s']:10.1f} "
            f"{r['ratio']:6.2f} {r['cpu_ms_per_step']:12.2f} {r['rows_per_step']:10.1f} "
            f"{r['mean_output_len']:9.1f} {r['stopped_rate']:8.1%} {r['fit_schema_rate']:11.1%}")
    return "\n".join(lines)
