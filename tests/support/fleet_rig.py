"""Fleets on loopback for the fleet tests (issue 34): in-process edges (:func:`edges`), edge-server
subprocesses (:class:`Edge`) and Debian's HAProxy in front of three of them (:class:`Proxy`, run with
the committed deploy/haproxy/haproxy.cfg as it is: only its environment variables name the loopback
addresses); sessions over any of them (:func:`sessions`) and the same sessions unbroken
(:func:`unbroken`).

``.ci/system-deps.sh`` installs haproxy; where it is missing the tests that need it fail with that
reason rather than skip (a proxy is not hardware).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import re
import signal
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

from tests.support.harness import EdgeProcess, device_config, load, run, target_greedy
from specdec.testbed import haproxy, procs
from specdec.common.modeling import ModelSpec, encode_prompt, vocab_fingerprint
from specdec.device.client import ConnectionPolicy, generate
from specdec.device.factory import open_channel
from specdec.device.session import DraftSession
from specdec.edge.batching import BatchSettings
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.server import EdgeConfig, start_server, stop_server

LOG_LINES = 2000
PROMPT = "w11 w12 w13"
MAX_NEW = 32
FLEET_SETTINGS = dict(mode="tslt", top_k=16)
# Reconnect at once and often: the tests measure what the fleet does, not how long backoff waits.
# Every break these tests make is loud (a killed process, a cancelled stream, an aborted relay), so
# the round timeout never has to detect one: it only has to outlast a round on a loaded shared
# machine, where a spurious timeout would add a reconnect the tests count.
POLICY = ConnectionPolicy(round_timeout_s=60.0, reconnect_timeout_s=30.0, backoff_initial_s=0.05,
                          backoff_max_s=0.5)
# The undisturbed reference run breaks nothing: nothing in it may time out however loaded the machine.
REFERENCE_POLICY = ConnectionPolicy(round_timeout_s=120.0, reconnect_timeout_s=120.0)
REFERENCE_TIMEOUT_S = 600.0
SESSION_TIMEOUT_S = 120.0
ALICE = "s3cret-alice"
# The fleets' edges do not batch: a batching edge advises shorter drafts as its load grows, so a T = 1
# session's round boundaries (and which random numbers its tokens use) would depend on timing, and
# "the same tokens as the unbroken run" would need the same load. The law holds either way
# (test_fleet_lossless); without the advice every round is the device's own fixed choice.
NO_BATCHING = BatchSettings(enabled=False)


class Edge:
    """One edge-server subprocess with a name, its probe/metrics port and a drained log."""

    def __init__(self, target_dir, name: str, *args: str, port: int = 0):
        self.name = name
        self.target_dir = str(target_dir)
        self.args = args
        self.probe_port = procs.free_port()
        self.proc = EdgeProcess("--model", self.target_dir, "--threads", "1", "--name", name,
                                "--metrics-port", str(self.probe_port), *args, port=port)
        self.port = self.proc.port
        self.log: collections.deque[str] = collections.deque(self.proc.lines, maxlen=LOG_LINES)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.proc.stdout:
            self.log.append(line)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.proc.poll() is None

    def metrics_text(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.probe_port}/metrics", timeout=10).read().decode()

    def metric(self, series: str) -> float:
        """One series (name and labels as exposed) of its /metrics; 0 if absent."""
        m = re.search(rf"^{re.escape(series)} (\S+)$", self.metrics_text(), re.M)
        return float(m.group(1)) if m else 0.0

    def value(self, name: str, labels: dict | None = None) -> float:
        """As InProcessEdge.value: one sample by name and labels (0 if dead or absent)."""
        if not self.alive():
            return 0.0
        label_text = ",".join(f'{k}="{v}"' for k, v in (labels or {}).items())
        return self.metric(f"{name}{{{label_text}}}" if label_text else name)

    def ready(self) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.probe_port}/readyz", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    @property
    def stopped(self) -> bool:
        return not self.alive()

    def kill(self) -> None:
        self.proc.proc.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.proc.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.proc.wait(timeout)

    def restart(self) -> "Edge":
        """A fresh process at the same port, name and probe port (a pod coming back)."""
        assert not self.alive()
        fresh = Edge.__new__(Edge)
        fresh.name, fresh.target_dir, fresh.args, fresh.probe_port = self.name, self.target_dir, self.args, self.probe_port
        fresh.proc = EdgeProcess("--model", self.target_dir, "--threads", "1", "--name", self.name,
                                 "--metrics-port", str(self.probe_port), *self.args, port=self.port)
        fresh.port = self.port
        fresh.log = collections.deque(fresh.proc.lines, maxlen=LOG_LINES)
        threading.Thread(target=fresh._drain, daemon=True).start()
        return fresh

    def stop(self) -> None:
        if self.alive():
            self.proc.stop()


def start_edges(target_dir, names, *args: str) -> list[Edge]:
    """Edges started side by side (each loads its model at the same time)."""
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        return list(pool.map(lambda name: Edge(target_dir, name, *args), names))


class Proxy(haproxy.Proxy):
    """The committed HAProxy config in front of three :class:`Edge` processes."""

    def __init__(self, edges: list[Edge]):
        super().__init__([(e.address, e.probe_port) for e in edges])


# -- in-process edges ------------------------------------------------------------------------------
@dataclass
class InProcessEdge:
    name: str
    address: str
    server: object
    metrics: EdgeMetrics
    stopped: bool = False

    async def kill(self) -> None:
        """Gone at once: every stream cancelled, the port closed (new connections refused)."""
        if not self.stopped:
            self.stopped = True
            await stop_server(self.server, grace=0)

    def value(self, name: str, labels: dict | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0


@contextlib.asynccontextmanager
async def edges(*specs):
    """In-process edges from (target_dir, name, EdgeConfig keywords) specs."""
    started: list[InProcessEdge] = []
    try:
        for target_dir, name, kw in specs:
            kw = {"host": "127.0.0.1", "port": 0, "workers": 2, "batching": NO_BATCHING, **kw}
            metrics = EdgeMetrics()
            cfg = EdgeConfig(model=ModelSpec(model=str(target_dir)), name=name, **kw)
            server, port = await start_server(cfg, load(str(target_dir)), metrics)
            started.append(InProcessEdge(name, f"{kw['host']}:{port}", server, metrics))
        yield started
    finally:
        for e in started:
            await e.kill()


def total(es, name: str, labels: dict | None = None) -> float:
    """A metric summed over edges."""
    return sum(e.value(name, labels) for e in es)


# -- sessions --------------------------------------------------------------------------------------
async def sessions(edges_or_channel, drafter_dir, seeds, temps, on_tokens=None, token=None, metrics=None,
                   max_new: int = MAX_NEW, policy: ConnectionPolicy = POLICY, timeout: float = SESSION_TIMEOUT_S,
                   settings: dict | None = None):
    """One session per (seed, temperature), all at once, over a channel or a Fleet: the results
    (GenerationResult, or the EdgeError a session ended with) in order. ``settings``: the draft
    settings (default TSLT, K = 16)."""
    drafter = load(str(drafter_dir))
    prompt = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    if token:
        policy = ConnectionPolicy(**{**policy.__dict__, "metadata": (("authorization", f"Bearer {token}"),)})

    async def one(seed, temperature):
        cfg = device_config(**(settings or FLEET_SETTINGS), temperature=temperature, max_new_tokens=max_new)
        hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=seed)
        return await generate(edges_or_channel, DraftSession(drafter, hello), hello, prompt, drafter.eos_token_ids,
                              on_tokens=on_tokens, timeout=timeout, policy=policy, metrics=metrics)
    return await asyncio.gather(*(one(s, t) for s, t in zip(seeds, temps)), return_exceptions=True)


def unbroken(target_dir, drafter_dir, seeds, temps, max_new: int = MAX_NEW,
             settings: dict | None = None) -> list[list[int]]:
    """The tokens of the same sessions against one edge that nothing disturbs; the greedy ones are
    checked against the target's own decode."""
    async def main():
        async with edges((target_dir, "reference", {})) as [ref]:
            async with open_channel(ref.address) as channel:
                return await sessions(channel, drafter_dir, seeds, temps, max_new=max_new,
                                      policy=REFERENCE_POLICY, timeout=REFERENCE_TIMEOUT_S, settings=settings)
    results = run(main())
    failed = [f"seed {s}, T = {t}: {type(r).__name__}: {r}"
              for s, t, r in zip(seeds, temps, results) if isinstance(r, BaseException)]
    assert not failed, f"the undisturbed reference run failed: {failed}"
    greedy = target_greedy(target_dir, encode_prompt(load(str(drafter_dir)).tokenizer, PROMPT, raw=True), max_new)
    for r, t in zip(results, temps):
        if t == 0:
            assert r.token_ids == greedy
    return [r.token_ids for r in results]


def kill_busiest_after(es, n_tokens: int, killed: list):
    """on_tokens: once ``n_tokens`` were delivered over all sessions, kill the edge running the most
    (an in-process edge is stopped at once, a subprocess gets SIGKILL); it is appended to ``killed``."""
    seen = {"n": 0}

    def on_tokens(new):
        seen["n"] += len(new)
        if seen["n"] >= n_tokens and not killed:
            victim = max((e for e in es if not e.stopped), key=lambda e: e.value("specdec_edge_sessions_active"))
            killed.append(victim)
            outcome = victim.kill()
            if asyncio.iscoroutine(outcome):
                asyncio.get_running_loop().create_task(outcome)
    return on_tokens
