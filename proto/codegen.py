"""Generate the Python protobuf / gRPC code for proto/specdec/v1/speculative.proto.

The one generator both build paths call: the packaging's build step (setup.py, when pip builds a
wheel or an editable install) and `make proto`. Needs grpcio-tools (a build requirement). The output
is git-ignored and never hand-edited.

    python proto/codegen.py OUT_DIR
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent / "specdec" / "v1"
PROTO_FILE = "speculative.proto"
GENERATED = ("speculative_pb2.py", "speculative_pb2.pyi", "speculative_pb2_grpc.py")
# protoc emits `import speculative_pb2 as ...` (grpc/grpc#29390); inside a package that must be a
# relative import, as TGI's Makefile rewrites it.
ABSOLUTE_IMPORT = re.compile(r"^import (speculative_pb2)\b", re.MULTILINE)


def generate(out_dir: str | Path) -> list[Path]:
    """Run protoc into ``out_dir`` and make the sibling imports package-relative; return the files."""
    from grpc_tools import protoc  # a build requirement, not a runtime one

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto shipped with grpcio-tools
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", str(PROTO_ROOT / PROTO_FILE)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO_FILE}")
    grpc_file = out / "speculative_pb2_grpc.py"
    grpc_file.write_text(ABSOLUTE_IMPORT.sub(r"from . import \1", grpc_file.read_text()))
    return [out / name for name in GENERATED]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python proto/codegen.py OUT_DIR")
    for path in generate(sys.argv[1]):
        print(path)
