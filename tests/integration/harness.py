"""In-process and subprocess harnesses around a real edge server on a real loopback port."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from specdec.common.codecs import Mode
from specdec.common.modeling import LoadedModel, ModelSpec, encode_prompt, load_model, vocab_fingerprint
from specdec.device.client import generate
from specdec.device.drafter import DraftSession
from specdec.device.runner import DeviceConfig, open_channel
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.server import EdgeConfig, start_server, stop_server
from specdec.edge.verifier import EdgeLimits

READY_RE = re.compile(r"ready on [\d.]+:(\d+)")
VENV_BIN = Path(sys.executable).parent


@lru_cache(maxsize=8)
def load(path: str) -> LoadedModel:
    return load_model(ModelSpec(model=path))


@contextlib.asynccontextmanager
async def edge(target_dir, limits: EdgeLimits | None = None, metrics: EdgeMetrics | None = None, **cfg_kw):
    """A real grpc.aio edge server on 127.0.0.1:<free port> inside the running loop."""
    cfg = EdgeConfig(model=ModelSpec(model=str(target_dir)), host="127.0.0.1", port=0,
                     limits=limits or EdgeLimits(), workers=2, **cfg_kw)
    server, port = await start_server(cfg, load(str(target_dir)), metrics)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await stop_server(server, grace=0)


def device_config(**kw) -> DeviceConfig:
    base = DeviceConfig(raw=True, draft_len=3, max_new_tokens=8)
    return replace(base, **kw)


async def run_sessions(address: str, drafter_dir, cfg: DeviceConfig, prompt: str, seeds,
                       session_factory=DraftSession, concurrency: int = 1):
    """Run one session per seed on one channel, ``concurrency`` at a time (results in seed order);
    return [(token_ids, GenerationResult, DraftSession)]. ``drafter_dir``: a checkpoint directory or
    an already loaded drafter."""
    drafter = drafter_dir if isinstance(drafter_dir, LoadedModel) else load(str(drafter_dir))
    prompt_ids = encode_prompt(drafter.tokenizer, prompt, raw=cfg.raw)
    fp = vocab_fingerprint(drafter.tokenizer)
    cfg = replace(cfg, edge=address)
    policy = cfg.policy()
    gate = asyncio.Semaphore(concurrency)

    async def one(channel, seed):
        async with gate:
            hello = cfg.hello(fp, drafter.vocab_size, seed=seed)
            session = session_factory(drafter, hello)
            r = await generate(channel, session, hello, prompt_ids, drafter.eos_token_ids, timeout=120,
                               policy=policy)
            return r.token_ids, r, session

    async with cfg.channel() as channel:  # TLS and token exactly as the CLI sets them up
        return list(await asyncio.gather(*(one(channel, seed) for seed in seeds)))


def run(coro):
    return asyncio.run(coro)


def target_greedy(target_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target model alone: transformers' own greedy generate."""
    import torch
    m = load(str(target_dir))
    ids = torch.tensor([prompt_ids])
    out = m.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=0, eos_token_id=list(m.eos_token_ids))
    return out[0, len(prompt_ids):].tolist()


class EdgeProcess:
    """`edge-server` as a real subprocess; waits for its ready line and reads the port from it."""

    def __init__(self, *args: str, env: dict | None = None, port: int = 0, bindir: Path = VENV_BIN,
                 cwd: Path | None = None):
        cmd = [str(bindir / "edge-server"), "--port", str(port), *args]
        merged = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        full_env = {k: v for k, v in merged.items() if v is not None}  # env={"X": None} unsets X
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                                     cwd=cwd)
        self.lines: list[str] = []
        self.port = self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("edge-server exited:\n" + "".join(self.lines))
            self.lines.append(line)
            m = READY_RE.search(line)
            if m:
                return int(m.group(1))
        raise TimeoutError("edge-server not ready:\n" + "".join(self.lines))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def device_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(VENV_BIN / "device-client"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


ALL_MODES = [m for m in Mode]
