"""Whether this Python can run the generated protobuf code in common/pb (carried to a GPU machine).

    python bench/gpucheck/runtime_check.py      # exit 0: yes; 1: what is missing, one line each

The code protoc generates refuses to import under a grpcio or protobuf older than the grpcio-tools
that generated it (pyproject.toml's build pin). A lent GPU machine has whatever versions its image
has and can fetch nothing: bench/gpu_check_device.sh then installs the wheels carried in .whl/
(`make gpu-wheels` here). Runs before the project is installed: standard library and the two
runtimes only.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

PB = Path(__file__).resolve().parents[2] / "common" / "pb"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def problems() -> list[str]:
    grpc_file, pb2_file = PB / "speculative_pb2_grpc.py", PB / "speculative_pb2.py"
    if not grpc_file.is_file() or not pb2_file.is_file():
        return [f"no generated code in {PB}: run `make proto` here and carry common/pb"]
    need_grpc = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_file.read_text()).group(1)
    gencode = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)", pb2_file.read_text())
    need_pb = ".".join(gencode.groups())
    out = []
    for name, module, need in (("grpcio", "grpc", need_grpc), ("protobuf", "google.protobuf", need_pb)):
        try:
            have = __import__(module, fromlist=["__version__"]).__version__
        except ImportError:
            out.append(f"{name} is not installed (the generated code needs >= {need})")
            continue
        if _version(have) < _version(need):
            out.append(f"{name} {have} is older than the generated code needs ({need})")
    return out


if __name__ == "__main__":
    found = problems()
    for line in found:
        print(f"runtime check: {line}", file=sys.stderr)
    sys.exit(1 if found else 0)
