"""Convert a GGUF file, an HF directory or a preset into an orbax checkpoint (the fast path;
logic and arguments: `ConvertConfig` in jaxpipe_bench.convert).

    python scripts/convert.py smollm2-135m out/smollm2-orbax [--dtype bfloat16]
    python -c "from jaxpipe import Engine; Engine(model='out/smollm2-orbax')"
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, convert  # noqa: E402

if __name__ == "__main__":
    convert.convert(cli.parse(__doc__, convert.ConvertConfig))
