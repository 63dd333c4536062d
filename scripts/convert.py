"""Convert a GGUF file, an HF directory or a preset into an orbax checkpoint (the fast path).

    python scripts/convert.py smollm2-135m out/smollm2-orbax [--dtype bfloat16]
    python -c "from jaxpipe import Engine; Engine(model='out/smollm2-orbax')"
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxpipe.model import loading, orbax_dir
from jaxpipe.model.presets import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="preset name, .gguf file or HF directory")
    parser.add_argument("output", help="directory to write the orbax checkpoint into")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the stored weights (default float32: lossless)")
    args = parser.parse_args()
    start = time.perf_counter()
    source = resolve_model(args.model)
    cfg, values = loading.load_weights(source)
    if args.dtype == "bfloat16":
        import ml_dtypes

        values = {k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in values.items()}
    orbax_dir.save_orbax(args.output, cfg, values, args.dtype)
    tokenizer = loading.load_tokenizer(source)
    if tokenizer is not None:
        tokenizer.save(args.output)
    print(f"wrote {args.output} ({args.dtype}, {cfg.num_params() / 1e6:.0f}M params) in "
          f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
