"""Regenerate jaxpipe/protocol/jaxpipe_pb2*.py from jaxpipe/protocol/jaxpipe.proto (needs
grpcio-tools).

Run from anywhere: `python scripts/gen_proto.py`. The proto is compiled with the repository root
as include path, so the generated gRPC module imports `jaxpipe.protocol.jaxpipe_pb2` (a package
import that works after `pip install`).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpc_tools import protoc  # noqa: E402

from jaxpipe_bench import cli  # noqa: E402

PROTO = "jaxpipe/protocol/jaxpipe.proto"


def main() -> int:
    cli.parser(__doc__).parse_args()  # no flags: --help, and no stray argument
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}", str(ROOT / PROTO)]
    code = protoc.main(args)
    if code:
        print(f"protoc failed with exit code {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
