"""Perplexity of a fixed English text through the engine's `prompt_logprobs`: the quality check
of the quantized paths (int8 weights, GGUF blocks, int8 KV) against the plain dtype, and of the
engine against HF transformers' float32 reading of the same GGUF.

The text (`TEXT`: the GNU GPL v3, 7,658 SmolLM2 tokens, shipped verbatim as its licence
allows; see data/README.md) is tokenized once, without special tokens, and cut into windows of
the engine's longest prompt, max_model_len - 1 tokens (it keeps a position for an output token
even when max_tokens=0; `windows`): window i starts i * stride tokens in and scores only
the tokens after the previous window's last, so consecutive windows share length - stride
tokens, which are context for the second, and every token but the text's first (which nothing
predicts) is scored exactly once. Each window is one request, `SamplingParams(prompt_logprobs=0,
max_tokens=0)`: position t - 1's log-softmax gives token t's logprob. Perplexity = exp(mean NLL
over the scored tokens).

The engine configurations are `dtypes` crossed with `--engine-field KEY=VALUE[,VALUE...]`
(EngineConfig fields, passed through as given: the quantization knobs plug in here unchanged);
the first is the one the others' ratio is to. The HF reference scores the same windows on the
same file with `AutoModelForCausalLM` in float32; torch and transformers are imported only there.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.model import Dtype
from jaxpipe_bench import engine_fields
from jaxpipe_bench.engine_fields import field_choices

Log = Callable[[str], None]

TEXT = Path(__file__).resolve().parent / "data" / "gpl-3.0.txt"


@dataclass(frozen=True)
class Window:
    """One request of the text: tokens [start, stop), of which [scored_from, stop) are scored
    (those before are context the previous window scored)."""

    start: int
    stop: int
    scored_from: int


def windows(num_tokens: int, length: int, stride: int) -> list[Window]:
    """Windows of at most `length` tokens over a text of `num_tokens`, starting every `stride`
    tokens (1 <= stride < length, so each window's first token is context only), until one
    reaches the text's end; each scores the tokens after the previous one's last."""
    if num_tokens < 2:
        raise ValueError(f"the text needs at least 2 tokens to score one, got {num_tokens}")
    if not 1 <= stride < length:
        raise ValueError(f"stride must be in [1, length - 1] = [1, {length - 1}] (windows "
                         f"must overlap by a token of context), got {stride}")
    out, scored_to = [], 1
    for start in range(0, num_tokens, stride):
        stop = min(start + length, num_tokens)
        out.append(Window(start, stop, scored_to))
        scored_to = stop
        if stop == num_tokens:
            break
    return out


def text_token_ids(tokenizer: Any, num_tokens: int | None = None, path: Path = TEXT) -> list[int]:
    """The text's token ids (no special tokens added), its first `num_tokens` when given."""
    ids = list(tokenizer.encode(path.read_text(), add_special_tokens=False))
    return ids if num_tokens is None else ids[:num_tokens]


def engine_nll(engine: Any, ids: Sequence[int], wins: Sequence[Window]) -> np.ndarray:
    """[scored tokens] f64: each scored token's negative logprob from the engine, in text
    order; all windows go in one `generate`."""
    from jaxpipe import SamplingParams

    params = SamplingParams(prompt_logprobs=0, max_tokens=0)
    outs = engine.generate(prompt_token_ids=[list(ids[w.start:w.stop]) for w in wins],
                           sampling_params=params, use_tqdm=False)
    return np.concatenate([_window_nll(out.prompt_logprobs, ids, w)
                           for out, w in zip(outs, wins, strict=True)])


def _window_nll(scores: Sequence[dict[int, float] | None], ids: Sequence[int],
                w: Window) -> np.ndarray:
    """A window's scored tokens' negative logprobs from its `prompt_logprobs` (entry j: the
    window's token j, keyed by its id)."""
    if scores is None or len(scores) != w.stop - w.start:
        got = None if scores is None else len(scores)
        raise RuntimeError(f"window [{w.start}, {w.stop}): {got} prompt logprobs, expected "
                           f"{w.stop - w.start}")
    return np.array([-scores[t - w.start][ids[t]] for t in range(w.scored_from, w.stop)],
                    dtype=np.float64)


def hf_nll(model: Any, ids: Sequence[int], wins: Sequence[Window]) -> np.ndarray:
    """[scored tokens] f64: the same as `engine_nll`, from an HF causal LM (its logits
    log-softmaxed in float64), one window per forward."""
    import torch

    out = []
    with torch.inference_mode():
        for w in wins:
            x = torch.tensor([list(ids[w.start:w.stop])])
            logp = torch.log_softmax(model(input_ids=x).logits[0].double(), dim=-1)
            j = torch.arange(w.scored_from - w.start, w.stop - w.start)
            out.append(-logp[j - 1, x[0, j]].numpy())
    return np.concatenate(out)


def load_hf_reference(model: str) -> Any:
    """HF transformers' float32 reading of the engine's `model` (a GGUF dequantized at load, as
    tests/conftest.py's `hf_model`; or an HF directory), in eval mode."""
    from jaxpipe.model.presets import resolve_model

    source = resolve_model(model)
    if source.kind not in ("gguf", "hf"):
        raise ValueError(f"model {model!r} is an {source.kind} checkpoint, which HF cannot "
                         "read: run with --no-hf-reference")
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise RuntimeError(f"the HF reference needs torch and transformers ({exc}): install "
                           "the test extra (pip install -e '.[test]'), or --no-hf-reference"
                           ) from exc
    where, gguf = ((source.path.parent, source.path.name) if source.kind == "gguf"
                   else (source.path, None))
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(where), gguf_file=gguf, dtype=torch.float32).eval()


def summary(nll: np.ndarray) -> dict:
    """Tokens scored, mean NLL (nats) and perplexity of per-token NLLs."""
    mean = float(np.mean(nll))
    return {"tokens_scored": int(nll.size), "mean_nll": mean, "perplexity": math.exp(mean)}


def engine_configs(dtypes: Sequence[str], fields: Sequence[str]) -> list[dict[str, Any]]:
    """The configurations to score: each dtype crossed with each field's values, in the order
    given (the first: every first value)."""
    return field_choices(fields, first=[("dtype", d) for d in dtypes])


@dataclass(frozen=True)
class PerplexityConfig:
    """What a perplexity run scores; each entry below is also its flag's help.

    model: the engine's model (a preset name or a path); the HF reference reads the same file.
    dtypes: the engine's dtypes, one configuration each (crossed with --engine-field's values).
    max_model_len: the engine's max_model_len; a window is its longest prompt,
        max_model_len - 1 tokens.
    stride: tokens from one window's start to the next's (None: half the window): consecutive
        windows share max_model_len - 1 - stride tokens, context for the second.
    num_tokens: score only the text's first N tokens (None: the whole text).
    hf_reference: also score the same windows with HF transformers in float32 on the same file.
    json_path: where the result's JSON is written.
    engine_fields: KEY=VALUE[,VALUE...], repeated: EngineConfig fields passed through as given
        (e.g. quantization=none,int8); each value is a configuration, crossed with the dtypes.
    """

    model: str = EngineConfig.model
    dtypes: tuple[Dtype, ...] = field(default=("bfloat16",), metadata={"flags": ("--dtype",)})
    max_model_len: int = 1024
    stride: int | None = None
    num_tokens: int | None = None
    hf_reference: bool = True
    json_path: str = field(default="out/perplexity.json", metadata={"flags": ("--json",)})
    engine_fields: tuple[str, ...] = field(default=(), metadata={"flags": ("--engine-field",),
                                                                 "repeat": True})

    def __post_init__(self) -> None:
        if not self.dtypes:
            raise ValueError("dtypes must name at least one dtype")
        if self.max_model_len < 3:
            raise ValueError(f"max_model_len must be >= 3, got {self.max_model_len}")
        if not 1 <= self.window_stride < self.window_len:
            raise ValueError(f"stride must be in [1, max_model_len - 2] = [1, "
                             f"{self.window_len - 1}] (windows overlap by a token of "
                             f"context at least), got {self.stride}")
        if self.num_tokens is not None and self.num_tokens < 2:
            raise ValueError(f"num_tokens must be None or >= 2, got {self.num_tokens}")
        engine_configs(self.dtypes, self.engine_fields)  # raises on a malformed field

    @property
    def window_len(self) -> int:
        """A window's tokens: the engine's longest prompt (a position kept for output)."""
        return self.max_model_len - 1

    @property
    def window_stride(self) -> int:
        """`stride`, else half the window."""
        return self.stride if self.stride is not None else self.window_len // 2


def score_config(cfg: PerplexityConfig, fields: dict[str, Any], ids: Sequence[int],
                 wins: Sequence[Window], log: Log) -> dict:
    """Build one engine (`fields` over the run's model and window length), score the windows,
    close it; the summary row, with the seconds it took."""
    from jaxpipe import Engine

    engine = Engine(EngineConfig(model=cfg.model, max_model_len=cfg.max_model_len,
                                 warmup=False, show_progress=False, **fields))
    start = time.perf_counter()
    try:
        nll = engine_nll(engine, ids, wins)
    finally:
        engine.close()
        gc.collect()
    row = {"engine": "jaxpipe", "fields": fields, **summary(nll),
           "elapsed_s": time.perf_counter() - start}
    log(f"[perplexity] {label(row)}: {row['perplexity']:.4f} over {row['tokens_scored']} tokens")
    return row


def score_hf(cfg: PerplexityConfig, ids: Sequence[int], wins: Sequence[Window],
             log: Log) -> dict:
    """HF transformers' float32 row on the same windows."""
    model = load_hf_reference(cfg.model)
    start = time.perf_counter()
    row = {"engine": "hf", "fields": {"dtype": "float32"}, **summary(hf_nll(model, ids, wins)),
           "elapsed_s": time.perf_counter() - start}
    log(f"[perplexity] {label(row)}: {row['perplexity']:.4f} over {row['tokens_scored']} tokens")
    return row


def label(row: dict) -> str:
    """A row's configuration in one cell: engine, then its fields."""
    return " ".join([row["engine"], engine_fields.label(row["fields"])]).strip()


def render(rows: Sequence[dict]) -> str:
    """The table: configuration, tokens scored, perplexity, ratio to the first row."""
    width = max(len("config"), *(len(label(r)) for r in rows))
    lines = [f"{'config':<{width}} {'tokens scored':>13} {'perplexity':>11} {'ratio':>7}"]
    lines.append("-" * len(lines[0]))
    for row in rows:
        ratio = row["perplexity"] / rows[0]["perplexity"]
        lines.append(f"{label(row):<{width}} {row['tokens_scored']:>13} "
                     f"{row['perplexity']:>11.4f} {ratio:>7.4f}")
    return "\n".join(lines)


def describe_text(ids: Sequence[int], wins: Sequence[Window], path: Path = TEXT) -> dict:
    """What was scored: the file, its sha256, its tokens and the windows."""
    return {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "tokens": len(ids), "windows": len(wins),
            "window_len": max(w.stop - w.start for w in wins),
            "stride": wins[1].start if len(wins) > 1 else None}


def run(cfg: PerplexityConfig, log: Log = print) -> dict:
    """Score every configuration (and HF's), print the table, write the JSON; the result."""
    from jaxpipe.model.presets import resolve_model
    from jaxpipe.model.tokenizer import Tokenizer
    from jaxpipe_bench.report import machine_info, write_json

    source = resolve_model(cfg.model)
    tokenizer = (Tokenizer.from_gguf(source.path) if source.kind == "gguf"
                 else Tokenizer.from_hf_dir(source.path))  # an HF or orbax directory
    ids = text_token_ids(tokenizer, cfg.num_tokens)
    wins = windows(len(ids), cfg.window_len, cfg.window_stride)
    result: dict[str, Any] = {"config": dataclasses.asdict(cfg), "machine": machine_info(),
                              "text": describe_text(ids, wins)}
    log(f"[perplexity] {result['text']}")
    rows = [score_config(cfg, fields, ids, wins, log)
            for fields in engine_configs(cfg.dtypes, cfg.engine_fields)]
    if cfg.hf_reference:
        rows.append(score_hf(cfg, ids, wins, log))
    result["rows"] = rows
    log(render(rows))
    log(f"wrote {write_json(result, cfg.json_path)}")
    return result


def parse(doc: str, argv: list[str] | None = None) -> PerplexityConfig:
    """The PerplexityConfig a command line describes: one flag per field, --engine-field
    repeated (each occurrence one field; its commas separate values, not fields)."""
    from jaxpipe_bench import cli

    return cli.parse(doc, PerplexityConfig, argv, group="perplexity")
