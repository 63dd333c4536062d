"""Attention per layer: the paged ragged-span C++ kernel (its default path, and paths asked for
by name) vs its XLA reference (logic in jaxpipe_bench.attention).

  python scripts/bench_attention.py --json out/attention.json
  python scripts/bench_attention.py --tables identity,shuffled --repeats 10
  python scripts/bench_attention.py --heads mistral --window 512 --paths portable \
      --cases "decode 64x2048,prefill 1x512 after 1536" --no-xla
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpipe_bench.attention import HEADS, SPAN_CASES, format_spans, measure_spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(list(SPAN_CASES)[:3]),
                        help=f"comma-separated span cases, of: {', '.join(SPAN_CASES)}")
    parser.add_argument("--tables", default="shuffled",
                        help="comma-separated block tables: identity, shuffled")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per pool block")
    parser.add_argument("--heads", default="smollm2", choices=list(HEADS),
                        help="the model whose head shapes to use")
    parser.add_argument("--windows", default="0",
                        help="comma-separated sliding windows (0: none)")
    parser.add_argument("--paths", default="",
                        help="comma-separated kernel paths to time by name as well (e.g. "
                             "portable,avx512_bf16)")
    parser.add_argument("--no-xla", action="store_true",
                        help="leave out the XLA reference (its gather needs [T, Hkv, MB*BS, "
                             "D] f32 per K and V)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_path", help="write the points here")
    args = parser.parse_args()
    paths = tuple(p for p in args.paths.split(",") if p)
    points = [measure_spans(c, *SPAN_CASES[c], block_size=args.block_size, table=t,
                            repeats=args.repeats, window=int(w), heads=args.heads,
                            paths=paths, xla=not args.no_xla)
              for c in args.cases.split(",") for t in args.tables.split(",")
              for w in args.windows.split(",")]
    print(format_spans(points))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(points, indent=2))


if __name__ == "__main__":
    main()
