"""Benchmark: the device's footprint with the default drafter (issue 20).

Two measurements, both of real ``device-client`` processes against an ``edge-server`` on loopback:
  * start-to-first-token: wall time from spawning ``device-client`` (text mode, one torch thread) to
    the first byte of generated text on its stdout, and its peak resident memory (``ru_maxrss`` of
    the finished child). The first run starts with the drafter's cache entry
    removed (``first_run_drafter_cache_cold``: it builds and saves it; the dequantized GGUF stays
    cached); the next ``--runs`` are warm-cache runs (median reported).
  * the breakdown: a ``--probe`` subprocess doing what device-client does, step by step, reading its
    own RSS after each: imports (torch, transformers, grpc and the device code), loading the drafter,
    prefill + ``--max-new-tokens`` decode steps (the KV cache; its bytes are also counted exactly).

    .venv/bin/python -m specdec.bench.bench_footprint [--runs 5] [--max-new-tokens 128] [--out FILE]

Writes results/bench_footprint.json and prints a summary. Which cache is used is
``$SPECDEC_CACHE_DIR`` (default ``~/.cache/specdec``), as for device-client itself.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specdec.bench.harness.plan import RESULTS


PROMPT = "Write a short story about a robot learning to paint."
FIRST_TOKEN_TIMEOUT_S = 300   # the first (cold) run may dequantize the GGUF and build the drafter
MIB = 1024 * 1024


def _rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB, from /proc (Linux)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def probe(max_new_tokens: int) -> dict:
    """RSS after each step of a device-client start, in this (fresh) process."""
    steps = {"python": _rss_mib()}
    import grpc  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from specdec.common.modeling import CachedLM, encode_prompt, load_model
    from specdec.device.factory import DeviceConfig, choose_drafter
    torch.set_num_threads(1)
    steps["imports (torch, transformers, grpc, specdec)"] = _rss_mib()
    t0 = time.perf_counter()
    drafter = load_model(choose_drafter(DeviceConfig()).spec)
    load_s = time.perf_counter() - t0
    steps["drafter loaded"] = _rss_mib()
    lm = CachedLM(drafter.model, drafter.device)
    ids = encode_prompt(drafter.tokenizer, PROMPT, raw=False)
    logits = lm.forward(ids, num_logits=1)
    steps["prefill"] = _rss_mib()
    for _ in range(max_new_tokens):
        logits = lm.forward([int(logits[-1].argmax())], num_logits=1)
    steps[f"prefill + {max_new_tokens} tokens"] = _rss_mib()
    kv_bytes = sum(t.numel() * t.element_size() for layer in lm.cache.layers for t in (layer.keys, layer.values))
    weights = {n: t for n, t in list(drafter.model.named_parameters()) + list(drafter.model.named_buffers())}
    weight_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in weights.values()}.values())
    return {"steps_mib": {k: {"rss": round(v[0], 1), "peak": round(v[1], 1)} for k, v in steps.items()},
            "load_seconds": load_s, "kv_cache_tokens": lm.cache_len, "kv_cache_mib": kv_bytes / MIB,
            "weight_tensors_mib": weight_bytes / MIB, "drafter": drafter.name}


def run_client(bindir: Path, port: int, max_new_tokens: int) -> dict:
    """One device-client process: seconds to its first output byte, total seconds, peak RSS."""
    cmd = [str(bindir / "device-client"), "--edge", f"127.0.0.1:{port}", "--prompt", PROMPT,
           "--max-new-tokens", str(max_new_tokens), "--threads", "1"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    rest = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"device-client failed ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
    return {"first_token_seconds": t_first, "total_seconds": time.perf_counter() - t0,
            "peak_rss_mib": usage.ru_maxrss / 1024, "text_bytes": 1 + len(rest)}


def _clear_drafter_cache() -> str:
    """Remove the default drafter's prebuilt entry, so that the first run builds it (cold drafter
    cache; the dequantized GGUF stays cached, as after an upgrade of the drafter)."""
    import shutil

    import torch

    from specdec.common.modeling import _source
    from specdec.device.factory import DeviceConfig, choose_drafter

    spec = choose_drafter(DeviceConfig()).spec
    source, kwargs, _ = _source(spec)
    path = spec.builder.cache.entry(spec, source, kwargs, torch.device("cpu"))
    shutil.rmtree(path, ignore_errors=True)
    return str(path)


def _probe_subprocess(max_new_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "specdec.bench.bench_footprint", "--probe",
                          "--max-new-tokens", str(max_new_tokens)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="warm-cache device-client runs after the first")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / "bench_footprint.json"))
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(args.max_new_tokens)))
        return
    from specdec.bench.harness.rig import Edge

    bindir = Path(sys.executable).parent
    edge = Edge(threads=1)
    port = edge.port
    try:
        cleared = _clear_drafter_cache()
        first = run_client(bindir, port, args.max_new_tokens)
        warm = [run_client(bindir, port, args.max_new_tokens) for _ in range(args.runs)]
    finally:
        edge.stop()
    breakdown = _probe_subprocess(args.max_new_tokens)
    result = {
        "first_run_drafter_cache_cold": first, "drafter_cache": cleared, "warm_runs": warm,
        "warm_first_token_seconds_median": statistics.median(r["first_token_seconds"] for r in warm),
        "warm_peak_rss_mib_median": statistics.median(r["peak_rss_mib"] for r in warm),
        "breakdown": breakdown, "max_new_tokens": args.max_new_tokens, "prompt": PROMPT,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "cache_dir": os.environ.get("SPECDEC_CACHE_DIR") or str(Path.home() / ".cache" / "specdec"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"first run (drafter cache cold): {first['first_token_seconds']:.2f} s to first token, peak RSS {first['peak_rss_mib']:.0f} MiB")
    print(f"warm ({args.runs} runs, median): {result['warm_first_token_seconds_median']:.2f} s to first token, "
          f"peak RSS {result['warm_peak_rss_mib_median']:.0f} MiB")
    for step, v in breakdown["steps_mib"].items():
        print(f"  {step:<45} RSS {v['rss']:7.1f} MiB  peak {v['peak']:7.1f} MiB")
    print(f"  weight tensors {breakdown['weight_tensors_mib']:.1f} MiB, KV cache {breakdown['kv_cache_mib']:.1f} MiB "
          f"({breakdown['kv_cache_tokens']} tokens); load_model {breakdown['load_seconds']:.2f} s")
    print(f"wrote {args.out}  (load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
