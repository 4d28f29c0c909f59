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

from specdec.common.modes import Mode
from specdec.common.modeling import LoadedModel, ModelSpec, encode_prompt, load_model, vocab_fingerprint
from specdec.device.client import generate
from specdec.device.session import DraftSession
from specdec.device.factory import DeviceConfig, connection_policy, edge_channel, open_channel
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.server import EdgeConfig, start_server, stop_server
from specdec.edge.verifier import EdgeLimits
from specdec.testbed import procs

ROOT = Path(__file__).resolve().parents[2]

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
    address = f"127.0.0.1:{port}"
    _SERVICERS[address] = server._specdec_servicer
    try:
        yield address
    finally:
        _SERVICERS.pop(address, None)
        await stop_server(server, grace=0)


_SERVICERS: dict = {}  # address -> servicer of the edges running now (what a test may wait on)


def servicer_of(address: str):
    """The servicer of the in-process edge at ``address`` (its session table, attached streams)."""
    return _SERVICERS[address]


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
    ``env`` overrides variables (a None value unsets one). With ``drain`` a thread keeps reading the
    rest into ``lines`` (an edge shared by many tests must never block on a full pipe)."""

    def __init__(self, *args: str, env: dict | None = None, port: int = 0, bindir: Path = VENV_BIN,
                 cwd: Path | None = None, drain: bool = False):
        super().__init__(procs.edge_server_cmd("--port", str(port), *args, bindir=bindir), name="edge-server",
                         env=procs.child_env(extra=env), ready_re=procs.EDGE_READY_RE,
                         ready_timeout=EDGE_READY_TIMEOUT_S, cwd=cwd, drain=drain)


def run_main(main, argv: list[str], capsys) -> tuple[int, str]:
    """A command's own ``main`` in this process (a bad flag's message and status need no process of
    their own): its exit status and what it wrote to stderr."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def assert_edge_flags_rejected(capsys, bad_argvs) -> None:
    """Each argv makes `edge-server` exit 2 with one line on stderr, before any model is loaded."""
    from specdec.edge import __main__ as edge_cli

    for argv in bad_argvs:
        rc, err = run_main(edge_cli.main, argv, capsys)
        assert rc == 2, argv
        assert len(err.strip().splitlines()) == 1 and err.startswith("edge-server: error:"), (argv, err)


def device_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "device-client"), *args], capture_output=True, text=True,
                          timeout=timeout, env=procs.child_env(extra=env))


ALL_MODES = [m for m in Mode]


# -- a second process for the statistical runs ------------------------------------------------------
# A statistical end-to-end test runs ~1000 short sessions, each a few milliseconds of CPU on both the
# device's and the edge's side, in one Python process: one core's worth of work (the GIL), while CI
# has two. ``Twin`` is a helper process started once per test session (the ``twin`` fixture) that
# runs the same function on its share of the seeds, with its own in-process edge, while this process
# runs the rest. Sessions are seeded, so each seed yields the same tokens wherever it runs: the
# merged results are exactly those of one process. Classes and functions defined under tests/ (a
# control's broken VerifierSession, a session factory) travel by file and name; ``patches``
# (module, attribute, value) are applied in both processes for the duration of the call.
TESTS_DIR = ROOT / "tests"
TWIN_TIMEOUT_S = 900.0
_FILE_MODULES: dict = {}


def _module_of_file(path: str):
    """The module loaded from ``path``: the one this process already has, or a fresh private one."""
    if path not in _FILE_MODULES:
        for module in list(sys.modules.values()):
            file = getattr(module, "__file__", None)
            if file and Path(file).resolve() == Path(path):
                _FILE_MODULES[path] = module
                break
        else:
            name = f"_twin_{Path(path).stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            _FILE_MODULES[path] = module
    return _FILE_MODULES[path]


def _resolve_ref(path: str, qualname: str):
    obj = _module_of_file(path)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _TestsPickler:
    """Pickles classes and functions defined in files under tests/ as (file, qualified name)."""

    @staticmethod
    def dumps(obj) -> bytes:
        import io
        import pickle
        import types

        class Pickler(pickle.Pickler):
            def reducer_override(self, o):
                if isinstance(o, (type, types.FunctionType)) and o is not _resolve_ref:
                    file = getattr(sys.modules.get(getattr(o, "__module__", None)), "__file__", None)
                    if file and Path(file).resolve().is_relative_to(TESTS_DIR) and "<locals>" not in o.__qualname__:
                        return _resolve_ref, (str(Path(file).resolve()), o.__qualname__)
                return NotImplemented

        buf = io.BytesIO()
        Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return buf.getvalue()


@contextlib.contextmanager
def _patched(patches):
    """Apply (module, attribute, value) patches (module: a module or its name), undone on exit."""
    import importlib
    undo = []
    try:
        for module, name, value in patches:
            module = importlib.import_module(module) if isinstance(module, str) else module
            undo.append((module, name, getattr(module, name)))
            setattr(module, name, value)
        yield
    finally:
        for module, name, old in reversed(undo):
            setattr(module, name, old)


def _twin_main(fd: int) -> None:
    """The helper process: run each job sent on ``fd`` and send back its result or its traceback."""
    import pickle
    import torch
    import traceback
    from multiprocessing.connection import Connection
    torch.set_num_threads(1)
    conn = Connection(fd)
    while True:
        try:
            job = conn.recv_bytes()
        except EOFError:
            return
        job_id = None
        try:
            job_id, fn, args, kwargs, patches = pickle.loads(job)
            with _patched(patches):
                reply = (job_id, "ok", fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
            reply = (job_id, "error", traceback.format_exc())
        try:
            payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001
            payload = pickle.dumps((job_id, "error", traceback.format_exc()))
        conn.send_bytes(payload)


class Twin:
    """The helper process (see above). ``split(fn, seeds, ...)`` runs ``fn(seeds_part, ...)`` on two
    halves of ``seeds``, one here and one there, at the same time, and returns both results."""

    def __init__(self, log_dir: Path):
        import os
        import socket
        from multiprocessing.connection import Connection
        here, there = socket.socketpair()
        self.log = Path(log_dir) / "twin.log"
        # ``python -c`` in the repository root imports the tests package from there, as pytest does
        code = f"from tests.support import harness; harness._twin_main({there.fileno()})"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(there.fileno(),), env=env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        there.close()
        self.conn = Connection(here.detach())
        self.jobs = 0

    def _fail(self, why: str):
        tail = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
        raise RuntimeError(f"twin process: {why}\n--- its log ---\n{tail}")

    def call_async(self, fn, *args, patches=(), **kwargs):
        """Send ``fn(*args, **kwargs)`` to the helper; returns a function that waits for the result."""
        import pickle
        if self.proc.poll() is not None:
            self._fail(f"exited with {self.proc.returncode}")
        patches = tuple((m if isinstance(m, str) else m.__name__, n, v) for m, n, v in patches)
        self.jobs += 1
        job_id = self.jobs
        self.conn.send_bytes(_TestsPickler.dumps((job_id, fn, args, kwargs, patches)))

        def result():
            while True:  # answers to earlier calls nobody waited for (a test that timed out) are dropped
                if not self.conn.poll(TWIN_TIMEOUT_S):
                    self._fail(f"no answer in {TWIN_TIMEOUT_S:.0f} s")
                try:
                    answer_id, status, value = pickle.loads(self.conn.recv_bytes())
                except EOFError:
                    self._fail(f"died (exit code {self.proc.wait(10)})")
                if answer_id in (job_id, None):
                    break
            if status != "ok":
                raise RuntimeError(f"in the twin process:\n{value}")
            return value
        return result

    def split(self, fn, seeds, *args, patches=(), **kwargs):
        """(fn(first half of seeds, ...) here, fn(second half, ...) in the helper), run concurrently."""
        seeds = list(seeds)
        half = (len(seeds) + 1) // 2
        there = self.call_async(fn, seeds[half:], *args, patches=patches, **kwargs)
        try:
            with _patched(patches):
                here = fn(seeds[:half], *args, **kwargs)
        finally:
            theirs = there()  # always collect, so that the next call's answer is not this one's
        return here, theirs

    def close(self) -> None:
        self.conn.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def load_spec(spec: ModelSpec | str | Path) -> LoadedModel:
    """A drafter or target from a directory or a ModelSpec, loaded once per process."""
    return load(str(spec)) if isinstance(spec, (str, Path)) else _load_spec(spec)


@lru_cache(maxsize=8)
def _load_spec(spec: ModelSpec) -> LoadedModel:
    return load_model(spec)


class SessionStats:
    """What a session run in another process brings back of its DraftSession: its stats."""

    def __init__(self, stats):
        self.stats = stats


def sessions_here(seeds, target_dir, drafter, cfg_kw: dict, prompt: str, session_factory=DraftSession,
                  concurrency: int = 1, edge_kw: dict | None = None):
    """``run_sessions`` with ``device_config(**cfg_kw)`` against a fresh in-process edge, as a picklable
    [(tokens, result, SessionStats)] (the unit of work of ``Twin.split``). ``drafter``: a directory or
    a ModelSpec."""
    async def main():
        async with edge(target_dir, **(edge_kw or {})) as address:
            return await run_sessions(address, load_spec(drafter), device_config(**cfg_kw), prompt, seeds,
                                      session_factory, concurrency)
    return [(tokens, r, SessionStats(s.stats)) for tokens, r, s in run(main())]


def split_sessions(twin: Twin | None, seeds, target_dir, drafter, cfg_kw: dict, prompt: str,
                   session_factory=DraftSession, concurrency: int = 1, patches=(), edge_kw: dict | None = None):
    """``sessions_here`` over ``seeds``, half in this process and half in ``twin`` (all here if None);
    results in seed order. ``patches`` are applied in both processes while the sessions run."""
    kw = dict(target_dir=target_dir, drafter=drafter, cfg_kw=cfg_kw, prompt=prompt, session_factory=session_factory,
              concurrency=concurrency, edge_kw=edge_kw)
    if twin is None:
        with _patched(patches):
            return sessions_here(list(seeds), **kw)
    here, there = twin.split(sessions_here, seeds, patches=patches, **kw)
    return here + there


def patched(patches):
    """Context manager: (module, attribute, value) patches applied here until exit (as ``Twin.split``
    applies them in both processes)."""
    return _patched(patches)
