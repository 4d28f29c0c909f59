#!/bin/sh
# `make gpu-check` on a lent GPU machine (docs/gpu.md): what the machine lacks, then the check.
# Its python3 holds torch 2.11 (CUDA 13) and transformers 5.17, and nothing can be fetched there, so:
# 1. the generated protobuf code is carried (common/pb); if the machine's grpcio or protobuf is older
#    than that code needs, the wheels carried in .whl/ (`make gpu-wheels` here) go to /tmp/site, first
#    on PYTHONPATH for this run and its children;
# 2. the project installs without dependencies and without build isolation (setup.py keeps the carried
#    code where grpcio-tools is absent); the machine's torch stays, no .venv is built;
# 3. the check (python -m specdec.bench.gpu_check) with the arguments given.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" bench/gpucheck/runtime_check.py; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        export PYTHONPATH
        "$PY" bench/gpucheck/runtime_check.py
    else
        echo "gpu-check: carry newer runtimes: run 'make gpu-wheels' where pip works and add .whl to the carried paths" >&2
        exit 1
    fi
fi
"$PY" -c "import specdec.common.pb.speculative_pb2_grpc" 2>/dev/null ||
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
exec "$PY" -m specdec.bench.gpu_check "$@"
