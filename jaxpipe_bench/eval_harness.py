"""scripts/eval_harness.py's logic: lm-evaluation-harness scores the default model twice, through
jaxpipe's OpenAI server (`local-completions`: `echo` + `logprobs` on token-id prompts for the
log-likelihoods, plain completions for `generate_until`) and through HF transformers
(`--model hf`) on the same GGUF dequantized to float32, and the two runs are compared: the
accuracy of each task, each choice's log-likelihood, each generation's text.

lm-eval and HF transformers live in the peers' environment (`requirements/peers.in`, built on
first use as the throughput benchmark's peers are); the server runs in this checkout's own.
The two tasks are local data written here (`MC_DOCS`, `GEN_DOCS`), so no dataset is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from jaxpipe_bench import peers
from jaxpipe_bench.report import machine_info, write_json
from jaxpipe_bench.soak_server import free_port
from jaxpipe_bench.workload import default_gguf_path

MC_TASK, GEN_TASK = "jaxpipe_mc", "jaxpipe_gen"
# (question, choices, index of the right one): each choice follows the question after a space.
MC_DOCS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Water freezes at a temperature of", ["100 degrees", "50 degrees", "0 degrees",
                                           "10 degrees"], 2),
    ("The opposite of hot is", ["warm", "loud", "bright", "cold"], 3),
    ("A baby cat is called a", ["kitten", "puppy", "calf", "foal"], 0),
    ("The color of a clear daytime sky is", ["green", "blue", "red", "purple"], 1),
    ("Bees make", ["milk", "silk", "honey", "wool"], 2),
    ("The number of days in a week is", ["five", "six", "eight", "seven"], 3),
    ("The sun rises in the", ["east", "west", "north", "south"], 0),
    ("A person who teaches students is a", ["pilot", "teacher", "farmer", "baker"], 1),
    ("Ice is frozen", ["sand", "air", "water", "oil"], 2),
    ("The first month of the year is", ["March", "June", "May", "January"], 3),
    ("Fish live in", ["water", "trees", "deserts", "clouds"], 0),
    ("We see with our", ["ears", "eyes", "hands", "feet"], 1),
    ("The Earth goes around the", ["Moon", "Mars", "Sun", "comet"], 2),
    ("Two plus two equals", ["three", "five", "six", "four"], 3),
    ("Paper is made from", ["wood", "glass", "iron", "stone"], 0),
    ("The tallest animal is the", ["mouse", "giraffe", "rabbit", "duck"], 1),
    ("Plants need sunlight and", ["plastic", "metal", "water", "smoke"], 2),
    ("The capital of Japan is", ["Beijing", "Seoul", "Bangkok", "Tokyo"], 3),
    ("A triangle has", ["three sides", "four sides", "five sides", "six sides"], 0),
    ("Snow is usually", ["black", "white", "orange", "pink"], 1),
    ("People sleep mostly at", ["noon", "dawn", "night", "lunch"], 2),
    ("The chemical symbol for gold is", ["Ag", "Fe", "Cu", "Au"], 3),
]
# (question, answer): greedy generation until a newline, scored by exact match.
GEN_DOCS = [
    ("What is the capital of France?", "Paris"),
    ("What color is the sky on a clear day?", "Blue"),
    ("How many legs does a spider have?", "Eight"),
    ("What is 3 plus 4?", "7"),
    ("What do bees make?", "Honey"),
    ("What is the opposite of up?", "Down"),
    ("Which planet do we live on?", "Earth"),
    ("What is frozen water called?", "Ice"),
    ("How many days are in a week?", "Seven"),
    ("What animal says moo?", "Cow"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
]
# Two worked examples before each generate_until question, so the answers come as one word.
_SHOTS = ("Question: What is the capital of Italy?\\nAnswer: Rome\\n\\n"
          "Question: How many wheels does a bicycle have?\\nAnswer: Two\\n\\n")
_MC_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""
_GEN_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{shots}Question: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
"""


@dataclass(frozen=True)
class EvalConfig:
    """scripts/eval_harness.py's flags.

    out: the lm-eval runs' outputs (samples, results) and the comparison's JSON
    tolerance: the largest accepted |log-likelihood| difference of one choice
    batch_size: lm-eval's batch size for both runs (local-completions sends that many prompts
      per request)
    timeout: seconds to wait for the server to load the model and serve
    """

    out: str = "out/eval_harness"
    tolerance: float = 1e-3
    batch_size: int = 8
    timeout: float = 900.0

    def __post_init__(self):
        if not self.tolerance > 0:
            raise ValueError(f"EvalConfig.tolerance must be > 0, got {self.tolerance!r}")
        if self.batch_size < 1:
            raise ValueError(f"EvalConfig.batch_size must be >= 1, got {self.batch_size!r}")


def write_tasks(root: Path) -> Path:
    """The two tasks' data and YAML under `root` (lm-eval's --include_path)."""
    root.mkdir(parents=True, exist_ok=True)
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in MC_DOCS]
    gen = [{"question": q, "answer": a} for q, a in GEN_DOCS]
    for task, docs, yaml in ((MC_TASK, mc, _MC_YAML), (GEN_TASK, gen, _GEN_YAML)):
        data = root / f"{task}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / f"{task}.yaml").write_text(yaml.format(task=task, data=data, shots=_SHOTS))
    return root


def _peers_env() -> dict:
    """Offline: lm-eval and transformers read only local files."""
    return {**os.environ, "PYTHONPATH": str(peers.ROOT), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def hf_checkpoint(python: Path, gguf: Path) -> Path:
    """The GGUF dequantized to a float32 HF checkpoint (cached by the peers)."""
    code = ("import sys; from pathlib import Path; from jaxpipe_peers.openvino import ensure_hf;"
            " print(ensure_hf(Path(sys.argv[1]), log=lambda m: print(m, file=sys.stderr)))")
    out = subprocess.run([str(python), "-c", code, str(gguf)], env=_peers_env(), check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def tokenizer_dir(gguf: Path, out: Path) -> Path:
    """The GGUF's tokenizer as an HF tokenizer directory, written by this checkout's
    transformers: the peers' older one (5.5) reads this GGUF's byte-level BPE as a SentencePiece
    tokenizer (spaces become <|endoftext|>), so both runs take this one instead."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


def lm_eval(python: Path, model: str, model_args: str, tasks: Path, out: Path,
            batch_size: int) -> Path:
    """One lm-eval run of both tasks; the directory its results and samples are in."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
           "--tasks", f"{MC_TASK},{GEN_TASK}", "--include_path", str(tasks), "--device", "cpu",
           "--batch_size", str(batch_size), "--log_samples", "--output_path", str(out)]
    print(f"[eval] {model}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, env=_peers_env(), check=True)
    return out


def start_server(log: Path) -> tuple[subprocess.Popen, str]:
    """`python -m jaxpipe.serve --dtype float32` on a free loopback port: (process, base URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxpipe.serve", "--no-grpc", "--http-port", str(port),
           "--dtype", "float32", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> str:
    """The served model's name, once `url`/health says the engine serves (200, not 503 while
    it loads and compiles); SystemExit if the server dies or takes longer than `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5).close()
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                return json.load(r)["data"][0]["id"]
        except OSError:  # refused, or an HTTPError 503
            time.sleep(1)
    raise SystemExit(f"the server at {url} did not serve within {timeout:.0f}s")


def samples(run_dir: Path, task: str) -> dict[int, dict]:
    """doc_id -> its logged sample, from the newest samples file of `task` under `run_dir`."""
    files = sorted(run_dir.rglob(f"samples_{task}_*.jsonl"), key=lambda f: f.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no samples of {task} under {run_dir}")
    return {s["doc_id"]: s for s in map(json.loads, files[-1].read_text().splitlines())}


def loglikelihoods(sample: dict) -> list[float]:
    """Each choice's log-likelihood in one multiple-choice sample."""
    return [float(r[0][0]) for r in sample["resps"]]


def compare(hf_dir: Path, jp_dir: Path) -> dict:
    """Accuracies, the largest log-likelihood difference and the generations that differ."""
    hf_mc, jp_mc = samples(hf_dir, MC_TASK), samples(jp_dir, MC_TASK)
    diffs = [abs(a - b) for i in hf_mc
             for a, b in zip(loglikelihoods(hf_mc[i]), loglikelihoods(jp_mc[i]), strict=True)]
    hf_gen, jp_gen = samples(hf_dir, GEN_TASK), samples(jp_dir, GEN_TASK)
    differ = [i for i in hf_gen if hf_gen[i]["filtered_resps"] != jp_gen[i]["filtered_resps"]]

    def mean(rows: dict, metric: str) -> float:
        return sum(float(s[metric]) for s in rows.values()) / len(rows)

    return {"mc_acc": {"hf": mean(hf_mc, "acc"), "jaxpipe": mean(jp_mc, "acc")},
            "mc_acc_norm": {"hf": mean(hf_mc, "acc_norm"), "jaxpipe": mean(jp_mc, "acc_norm")},
            "gen_exact_match": {"hf": mean(hf_gen, "exact_match"),
                                "jaxpipe": mean(jp_gen, "exact_match")},
            "choices": len(diffs), "max_loglikelihood_diff": max(diffs),
            "generations_differ": differ}


def render(result: dict, tolerance: float) -> str:
    """The comparison as a table, and whether it holds."""
    lines = [f"{'metric':<18} {'HF f32':>8} {'jaxpipe':>8}"]
    for name in ("mc_acc", "mc_acc_norm", "gen_exact_match"):
        lines.append(f"{name:<18} {result[name]['hf']:>8.4f} {result[name]['jaxpipe']:>8.4f}")
    lines.append(f"largest |log-likelihood diff| over {result['choices']} choices: "
                 f"{result['max_loglikelihood_diff']:.2e} (tolerance {tolerance:g})")
    lines.append(f"generations that differ: {result['generations_differ'] or 'none'}")
    lines.append(f"agree: {result['agree']}")
    return "\n".join(lines)


def agrees(result: dict, tolerance: float) -> bool:
    return (all(result[k]["hf"] == result[k]["jaxpipe"]
                for k in ("mc_acc", "mc_acc_norm", "gen_exact_match"))
            and result["max_loglikelihood_diff"] <= tolerance and not result["generations_differ"])


def run(config: EvalConfig) -> dict:
    """Both runs and their comparison (written to `config.out`/eval_harness.json)."""
    out = Path(config.out)
    tasks, python, gguf = write_tasks(out / "tasks"), peers.ensure_env(), default_gguf_path()
    hf, tok = hf_checkpoint(python, gguf), tokenizer_dir(gguf, out / "tokenizer")
    lm_eval(python, "hf", f"pretrained={hf},tokenizer={tok},dtype=float32", tasks, out / "hf",
            config.batch_size)
    proc, url = start_server(out / "server.log")
    try:
        name = wait_ready(url, proc, config.timeout)
        args = (f"model={name},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={tok},tokenized_requests=True,num_concurrent=1,max_retries=1")
        lm_eval(python, "local-completions", args, tasks, out / "jaxpipe", config.batch_size)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = compare(out / "hf", out / "jaxpipe")
    result.update(agree=agrees(result, config.tolerance), tolerance=config.tolerance,
                  machine=machine_info())
    write_json(result, out / "eval_harness.json")
    print(render(result, config.tolerance))
    return result
