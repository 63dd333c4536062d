"""lm-evaluation-harness through jaxpipe's server against HF transformers, on the default model
in float32: a multiple-choice task (each choice's log-likelihood from `echo` + `logprobs`) and
a `generate_until` task, both local data; prints both runs' accuracies, the largest
log-likelihood difference, and exits 1 unless they agree (logic in
jaxpipe_bench/eval_harness.py; lm-eval runs in the peers' environment, built on first use).

    python scripts/eval_harness.py [--out out/eval_harness] [--tolerance 1e-3]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, eval_harness  # noqa: E402

if __name__ == "__main__":
    sys.exit(0 if eval_harness.run(cli.parse(__doc__, eval_harness.EvalConfig))["agree"] else 1)
