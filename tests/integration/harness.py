"""In-process and subprocess harnesses around a real edge server on a real loopback port."""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import subprocess
import sys
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from specdec.common.codecs import Mode
from specdec.common.modeling import LoadedModel, ModelSpec, encode_prompt, load_model, vocab_fingerprint
from specdec.common.settings import resolve as resolve_settings
from specdec.device.client import generate
from specdec.device.drafter import DraftSession
from specdec.device.runner import DeviceConfig, connection_policy, edge_channel, open_channel
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.server import EdgeConfig, start_server, stop_server
from specdec.edge.verifier import EdgeLimits

ROOT = Path(__file__).resolve().parents[2]


def import_testbed() -> None:
    """Import the repo's top-level ``testbed`` package without putting the repo root on sys.path
    (which would let a stray ``import common`` succeed)."""
    if "testbed" not in sys.modules:
        spec = importlib.util.spec_from_file_location("testbed", ROOT / "testbed" / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / "testbed")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["testbed"] = module
        spec.loader.exec_module(module)


import_testbed()
from testbed import procs  # noqa: E402

VENV_BIN = procs.BIN
EDGE_READY_TIMEOUT_S = 120.0   # a test's edge loads a tiny model: two minutes means it is stuck


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
    """A test session's config from flat keywords (draft settings such as ``mode`` or ``top_k`` too)."""
    return DeviceConfig.of(**{"raw": True, "draft_len": 3, "max_new_tokens": 8, **kw})


async def run_sessions(address: str, drafter_dir, cfg: DeviceConfig, prompt: str, seeds,
                       session_factory=DraftSession, concurrency: int = 1):
    """Run one session per seed on one channel, ``concurrency`` at a time (results in seed order);
    return [(token_ids, GenerationResult, DraftSession)]. ``drafter_dir``: a checkpoint directory or
    an already loaded drafter."""
    drafter = drafter_dir if isinstance(drafter_dir, LoadedModel) else load(str(drafter_dir))
    prompt_ids = encode_prompt(drafter.tokenizer, prompt, raw=cfg.raw)
    fp = vocab_fingerprint(drafter.tokenizer)
    cfg = replace(cfg, edge=address)
    policy = connection_policy(cfg)
    gate = asyncio.Semaphore(concurrency)

    async def one(channel, seed):
        async with gate:
            hello = cfg.hello(fp, drafter.vocab_size, seed=seed)
            session = session_factory(drafter, hello)
            r = await generate(channel, session, hello, prompt_ids, drafter.eos_token_ids, timeout=120,
                               policy=policy)
            return r.token_ids, r, session

    async with edge_channel(cfg) as channel:  # TLS and token exactly as the CLI sets them up
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


class EdgeProcess(procs.ReadyProcess):
    """`edge-server` as a real subprocess on loopback, started with the testbed's launcher. Its log
    up to the ready line is in ``lines``; later output stays in ``proc.stdout`` for the test to read.
    ``env`` overrides variables (a None value unsets one)."""

    def __init__(self, *args: str, env: dict | None = None, port: int = 0, bindir: Path = VENV_BIN,
                 cwd: Path | None = None):
        super().__init__(procs.edge_server_cmd("--port", str(port), *args, bindir=bindir), name="edge-server",
                         env=procs.child_env(extra=env), ready_re=procs.EDGE_READY_RE,
                         ready_timeout=EDGE_READY_TIMEOUT_S, cwd=cwd, drain=False)


def device_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "device-client"), *args], capture_output=True, text=True,
                          timeout=timeout, env=procs.child_env())


ALL_MODES = [m for m in Mode]


class SwitchesEveryRound(DraftSession):
    """A device whose settings change every round, as a link-aware controller's would: the round
    index and the seed pick one of ``PLAN`` (modes, K, lattice, length, a tree), and each Draft says
    how it was drafted. Transitions include a DSSD rejection followed by a round of another mode."""

    PLAN: tuple[dict, ...] = (
        dict(mode="tslt", top_k=3), dict(mode="dssd", dssd_samples=1), dict(mode="dense", dense_dtype="bf16"),
        dict(mode="ksqs", top_k=3, lattice=8), dict(mode="csqs", csqs_beta0=0.05, lattice=8, max_k=8),
        dict(mode="tslt", top_k=4, tree=(2,)), dict(mode="none", edge_tokens=1))

    def choose_settings(self):
        plan = self.PLAN[(self.hello.seed + self.round_id) % len(self.PLAN)]
        self.settings = resolve_settings({"draft_len": self.hello.draft.draft_len, **plan},
                                         vocab_size=self.vocab_size)
