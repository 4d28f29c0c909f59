"""`make demo`: an edge-server and a device-client on loopback with the embedded defaults.

Starts ``edge-server`` as a subprocess, waits for its ready line, runs ``device-client`` once with a
fixed prompt and ``--json``, prints the answer and its stats, and stops the edge (SIGTERM).
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "What is the capital of France? Answer in one sentence."
READY = re.compile(r"ready on ")
STARTUP_TIMEOUT_S = 300  # the embedded GGUF is dequantized at load: ~20-30 s on 2 CPU cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("edge-server exited before it was ready")
        sys.stderr.write(f"[edge] {line}")
        if READY.search(line):
            return
    raise TimeoutError("edge-server did not become ready")


def main(argv: list[str] | None = None) -> int:
    extra = list(argv if argv is not None else sys.argv[1:])
    bindir = Path(sys.executable).parent
    port = _free_port()
    # Both processes share this host's cores: one torch thread each avoids oversubscription.
    edge = subprocess.Popen([str(bindir / "edge-server"), "--port", str(port), "--threads", "1"],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_ready(edge)
        cmd = [str(bindir / "device-client"), "--edge", f"127.0.0.1:{port}", "--prompt", PROMPT,
               "--max-new-tokens", "48", "--threads", "1", "--json", *extra]
        sys.stderr.write("[device] " + " ".join(cmd[1:]) + "\n")
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.stderr.write(run.stderr)
            return run.returncode
        record = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"prompt: {PROMPT}\nanswer: {record['text'].strip()}\n")
        print(json.dumps(record["stats"], indent=2))
        return 0
    finally:
        edge.terminate()
        edge.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
