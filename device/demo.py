"""`make demo`: the pair on loopback against the target alone, on one prompt, in one run.

Starts ``edge-server`` as a subprocess (no thread flag: the shared-host rule of common/runtime.py
applies), runs the device in this process through the same path as ``device-client`` (the answer
streams as the edge verifies it), stops the edge, then runs the target alone (transformers
``generate`` with its KV cache, on one core and on every core, the faster counts) on the same prompt,
temperature, seed and token budget,
and prints a short summary: tokens/s of both, the speedup, acceptance, mean accepted length, and the
uplink bytes per token against dense fp16 distributions. ``--json`` prints the whole record instead.
The target alone gets an untimed warm-up generate and the pair does not (its first round pays the
edge's first forward), so the speedup errs low. One prompt on shared cores is noisy: for a ratio to
quote, see `make bench-defaults` and `make bench-drafter`.

    python -m specdec.device.demo [--json] [--target-model DIR [--target-gguf-file F]] [device-client flags]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from specdec.common.modeling import LoadedModel, ModelSpec, encode_prompt, load_model
from specdec.common.runtime import OneLineParser, apply_threads, run_async, usable_cores
from specdec.device.cli import build_parser, config_from_args
from specdec.device.factory import DeviceConfig
from specdec.device.runner import run_device

PROMPT = "Explain speculative decoding in two sentences."
MAX_NEW_TOKENS = 64    # two sentences: enough rounds for a rate, short enough for a demo
EDGE_PLACEHOLDER = "127.0.0.1:1"  # replaced by the started edge's address
WARMUP_TOKENS = 4      # an untimed first generate: the target alone's timing excludes one-time setup
READY = re.compile(r"ready on ")
STARTUP_TIMEOUT_S = 300  # the embedded GGUF is dequantized at first load: ~20-30 s on 2 CPU cores
DENSE_FP16_BYTES = 2     # what one probability costs in `--mode dense --dense-dtype fp16`


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_edge(args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """edge-server on a free loopback port; echoes its log until ready, then drains it."""
    port = _free_port()
    cmd = [str(Path(sys.executable).parent / "edge-server"), "--port", str(port), *args]
    edge = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        line = edge.stdout.readline()
        if not line:
            raise RuntimeError("edge-server exited before it was ready")
        sys.stderr.write(f"[edge] {line}")
        if READY.search(line):
            # A full pipe would block the edge's logging, and with it the edge.
            threading.Thread(target=lambda: [None for _ in edge.stdout], daemon=True).start()
            return edge, port
    edge.terminate()
    raise TimeoutError("edge-server did not become ready")


def _thread_counts() -> list[int]:
    """Thread counts the target alone is timed with: one core and every core (the faster is the
    baseline; on a loaded host one thread can win), or only what OMP_NUM_THREADS says."""
    if os.environ.get("OMP_NUM_THREADS"):
        return [torch.get_num_threads()]
    return sorted({1, usable_cores()})


@torch.inference_mode()
def time_generate(target: LoadedModel, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                  seed: int, threads: int) -> dict:
    """One timed transformers ``generate`` of the target alone (KV cache on; plain sampling at T > 0,
    greedy at T = 0) after an untimed warm-up, on ``threads`` torch threads."""
    torch.set_num_threads(threads)
    ids = torch.tensor([prompt_ids])
    sampling = (dict(do_sample=False) if temperature == 0 else
                dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0))
    common = dict(attention_mask=torch.ones_like(ids), eos_token_id=list(target.eos_token_ids),
                  pad_token_id=target.eos_token_ids[0], use_cache=True, **sampling)
    target.model.generate(ids, max_new_tokens=WARMUP_TOKENS, **common)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = target.model.generate(ids, max_new_tokens=max_new_tokens, **common)
    wall = time.perf_counter() - t0
    token_ids = [int(t) for t in out[0, len(prompt_ids):]]
    return {"token_ids": token_ids, "wall_seconds": wall, "tokens_per_second": len(token_ids) / wall,
            "threads": threads}


def target_alone(spec: ModelSpec, cfg: DeviceConfig) -> dict:
    """The target by itself on the demo's prompt, temperature, seed and token budget at each of
    _thread_counts(); returns the fastest run."""
    target = load_model(spec)
    prompt_ids = encode_prompt(target.tokenizer, cfg.prompt, raw=cfg.raw)
    runs = [time_generate(target, prompt_ids, cfg.max_new_tokens, cfg.temperature, cfg.seed, threads)
            for threads in _thread_counts()]
    best = max(runs, key=lambda r: r["tokens_per_second"])
    tried = {r["threads"]: round(r["tokens_per_second"], 2) for r in runs}
    return {**best, "tokens_per_second_by_threads": tried, "vocab_size": target.vocab_size}


def _threads_tried(alone: dict) -> str:
    tried = alone.get("tokens_per_second_by_threads", {alone["threads"]: alone["tokens_per_second"]})
    return ", ".join(f"{t} thread(s) {tps:.1f}" for t, tps in tried.items())


def summary_lines(record: dict, alone: dict, temperature: float) -> list[str]:
    """The human summary of one demo run. Dense fp16 cost: one fp16 probability per vocabulary entry
    per drafted position (``draft_positions``), divided by the generated tokens; no framing counted."""
    s = record["stats"]
    n = max(s["generated_tokens"], 1)
    dense = alone["vocab_size"] * DENSE_FP16_BYTES * s["draft_positions"] / n
    up = s["uplink_bytes_per_token"]
    lines = [
        f"pair (edge + device): {s['tokens_per_second']:6.1f} tok/s  "
        f"({s['generated_tokens']} tokens in {s['wall_seconds']:.2f} s)",
        f"target alone:         {alone['tokens_per_second']:6.1f} tok/s  ({len(alone['token_ids'])} tokens in "
        f"{alone['wall_seconds']:.2f} s, {alone['threads']} thread(s): the faster of {_threads_tried(alone)})",
        f"speedup:              {s['tokens_per_second'] / alone['tokens_per_second']:.2f}x",
        f"acceptance:           {s['acceptance_rate']:.2f} ({s['accepted_tokens']} of {s['draft_positions']} "
        f"drafted tokens), {s['mean_accepted_length']:.2f} accepted per round over {s['rounds']} rounds",
        f"uplink:               {up:,.0f} B per token ({record['mode']}); dense fp16 would send {dense:,.0f} B "
        f"({alone['vocab_size']:,} x {DENSE_FP16_BYTES} B per drafted position, "
        f"{s['draft_positions'] / n:.1f} positions per token): {dense / up if up else float('inf'):,.0f}x less",
    ]
    if temperature == 0:
        same = record["token_ids"] == alone["token_ids"]
        lines.append("greedy:               " + ("same tokens as the target alone" if same else
                                                 "TOKENS DIFFER from the target alone"))
    return lines


def _parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    demo = OneLineParser(prog="demo", allow_abbrev=False, add_help=False)
    demo.add_argument("--json", action="store_true", help="print the full record as one JSON object")
    demo.add_argument("--target-model", help="edge-server --model (default: the embedded target)")
    demo.add_argument("--target-gguf-file", help="edge-server --gguf-file")
    ours, rest = demo.parse_known_args(argv)
    # Later flags win in argparse: the user's --prompt / --max-new-tokens override the demo's. The edge
    # address is a placeholder (a valid one: --edge is checked) until the edge says its port.
    device = build_parser().parse_args(["--edge", EDGE_PLACEHOLDER, "--prompt", PROMPT,
                                        "--max-new-tokens", str(MAX_NEW_TOKENS), *rest])
    return ours, device


def main(argv: list[str] | None = None) -> int:
    ours, args = _parse(list(sys.argv[1:] if argv is None else argv))
    target = [*(["--model", ours.target_model] if ours.target_model else []),
              *(["--gguf-file", ours.target_gguf_file] if ours.target_gguf_file else [])]
    edge, port = start_edge(target)
    try:
        cfg = replace(config_from_args(args), edge=f"127.0.0.1:{port}", json=False, num_samples=1)
        apply_threads("device-client", args.threads, True)
        out = io.StringIO() if ours.json else sys.stdout
        if not ours.json:
            print(f"prompt: {cfg.prompt}\nanswer: ", end="", flush=True)
        (record,) = run_async(run_device(cfg, out=out))
    except Exception as exc:  # any failure: one line and a non-zero status, as device-client
        sys.stderr.write(f"demo: error: {exc}\n")
        return 1
    finally:
        edge.terminate()
        edge.wait(timeout=30)
    alone = target_alone(ModelSpec(model=ours.target_model, gguf_file=ours.target_gguf_file), cfg)
    lines = summary_lines(record, alone, cfg.temperature)
    if ours.json:
        print(json.dumps({"prompt": cfg.prompt, **record, "target_alone": alone, "summary": lines}))
    else:
        print("\n".join(["", *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
