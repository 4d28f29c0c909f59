"""gpu-check: the edge on a GPU, measured in one prepared command (issue 32).

    make gpu-check                                   # on a lent GPU machine: ~6-8 min, one H100 / H200
    make gpu-check ARGS=--cpu-smoke                  # here: tiny models on the CPU, ~30 s (the default suite runs it)
    python -m specdec.bench.gpu_check [--cpu-smoke] [--out DIR] [--models smollm2-135m,llama-1b,llama-8b]
        [--budget-s 420] [--skip-tests] [--ns 32,1,8,64,16,4,2] [--tokens 48] [--draft-ms 2]

Per model (random-initialised from configs, bfloat16; bench/gpucheck/models.py says how and why):
(a) the `gpu` tests (tests/gpu, once for all models) and the model's own greedy identity: the edge's
    greedy path equals transformers' greedy generate of the same weights, and no replayed verdict
    leaves it;
(b) the cost of one forward: c(T) for one session and T = 1..256 new tokens, c(B x L) for B = 1..64
    sessions of L = 1 and 5 tokens, at 256 and 2048 cached tokens, with KV slots and (B <= 32) with
    per-session caches, next to the weight-read floor from a device-to-device copy on the same card;
    and what a CUDA graph would save on one such forward;
(c) capacity: bench-capacity's replay load generator against real `edge-server --device cuda`
    processes on loopback, N = 1..64, batched vs --no-batching vs edge-only, proposals from the
    target's own greedy path at acceptance 0.6 and 0.8 (bench/gpucheck/capacity.py);
(d) time per phase of one batched round (inputs, cache copies, forward, appends, logits, and the
    verification math on the device against the host path).
Writes gpu_check.json and gpu_check.png to $OUT when set, else results/gpu_check/<timestamp>/; prints
a summary with the issue's goals. Each stage writes the JSON as it ends, and a stage past the time
budget is skipped and said so, so a run cut short still returns what it measured.
"""
from __future__ import annotations

import datetime as dt
import gc
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specdec.bench.gpucheck import capacity as C
from specdec.bench.gpucheck import measure as M
from specdec.bench.gpucheck import models

ROOT = Path(__file__).resolve().parents[1]   # the checkout (installed editable): tests/gpu, results/

RESULTS = ROOT / "results" / "gpu_check"
GOAL_FLOOR = 1.5      # one session's 5-token forward at 256 cached tokens, over the weight-read floor
GOAL_BATCH = 1.5      # 32 sessions x 5 tokens over one session's 5 tokens
TESTS_TIMEOUT_S = 180   # the tier takes ~1-2 min on a GPU; the models need the rest of 8 minutes
MODEL_WEIGHT = {"smollm2-135m": 0.2, "llama-1b": 0.3, "llama-8b": 0.5}  # shares of the time left


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: str
    models: tuple[str, ...]
    curves: M.CurvePlan
    capacity: C.Settings
    phase_batch: int
    graph_batches: tuple[int, ...]
    bandwidth_bytes: int
    budget_s: float
    smoke: bool

    def to_json(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "models": self.models, "curves": self.curves.__dict__,
                "capacity": self.capacity.__dict__, "phase_batch": self.phase_batch,
                "graph_batches": self.graph_batches, "budget_s": self.budget_s, "smoke": self.smoke}


GPU = Plan(device="cuda", dtype="bfloat16", models=models.GPU_MODELS,
           curves=M.CurvePlan(tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256), batches=(1, 2, 4, 8, 16, 32, 64),
                              batch_tokens=(1, 5), contexts=(256, 2048), per_session_batches=(1, 8, 32)),
           capacity=C.Settings(ns=(32, 1, 8, 64, 16, 4, 2), alphas=(0.8, 0.6), tokens=48, prompts=8, prompt_len=32,
                               draft_len=8, draft_max=16, draft_ms=2.0),
           phase_batch=32, graph_batches=(1, 32), bandwidth_bytes=2 << 30, budget_s=420.0, smoke=False)
SMOKE = Plan(device="cpu", dtype="float32", models=models.SMOKE_MODELS,
             curves=M.CurvePlan(tokens=(1, 4, 16), batches=(1, 4), batch_tokens=(5,), contexts=(16, 64),
                                per_session_batches=(1, 4), repeats=2, warmup=1),
             capacity=C.Settings(ns=(2, 1), alphas=(0.8,), tokens=8, prompts=2, prompt_len=6, draft_len=4,
                                 draft_max=6, draft_ms=0.0, edge_args=("--kv-cache", "slots")),
             phase_batch=4, graph_batches=(), bandwidth_bytes=32 << 20, budget_s=120.0, smoke=True)


# ---------------------------------------------------------------------------------- stages
def run_tests(plan: Plan) -> dict:
    """(a) the gpu tier (tests/gpu) on the plan's device."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S,
                              env={**os.environ, "SPECDEC_GPU_TEST_DEVICE": plan.device})
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        return {"command": " ".join(cmd[2:]), "returncode": proc.returncode, "summary": lines[-1] if lines else "",
                "tail": lines[-40:], "seconds": time.perf_counter() - t0}
    except subprocess.TimeoutExpired as exc:
        return {"command": " ".join(cmd[2:]), "returncode": None, "summary": f"timed out after {TESTS_TIMEOUT_S} s",
                "tail": (exc.stdout or "").splitlines()[-40:] if isinstance(exc.stdout, str) else [],
                "seconds": time.perf_counter() - t0}


def greedy_alone(model, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """transformers' own greedy generate of every prompt (one batch, equal lengths), and the smallest
    margin between the top two logits it met, relative to the top one."""
    ids = torch.tensor(prompts, device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    margin = 1.0
    for scores in out.scores:  # [P, V] per step
        top = scores.float().topk(2, dim=-1).values
        margin = min(margin, float(((top[:, 0] - top[:, 1]) / top[:, 0].abs().clamp_min(1e-6)).min()))
    return out.sequences[:, ids.shape[1]:].tolist(), margin


def measure_model(result: dict, plan: Plan, deadline: float, workdir: Path, say, save) -> None:
    """Fill ``result`` (already in the JSON) stage by stage, ``save()`` after each: a run cut short
    keeps what it measured."""
    name = result["name"]
    shape = models.SHAPES[name]
    device = torch.device(plan.device)
    dtype = getattr(torch, plan.dtype)
    t0 = time.perf_counter()
    model = models.build(shape, plan.device, dtype)
    result.update(models.describe(shape, model), build_s=time.perf_counter() - t0)
    say(f"{name}: {result['parameters'] / 1e6:.4g}M parameters, {result['weight_bytes'] / 2**20:.4g} MiB, "
        f"built in {result['build_s']:.1f} s")
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(1, shape.vocab, (plan.capacity.prompts, plan.capacity.prompt_len), generator=g).tolist()
    alone, margin = greedy_alone(model, prompts, plan.capacity.tokens)
    result["greedy"] = {"min_relative_margin": margin}
    t = time.perf_counter()
    result["cost"] = M.cost_curves(model, device, plan.curves)
    result["cost_s"] = time.perf_counter() - t
    say(f"  cost curves in {result['cost_s']:.1f} s")
    save()
    result["phases"] = M.phases(model, device, plan.phase_batch, 4, plan.curves.contexts[0], shape.vocab)
    result["graphs"] = [M.graph_probe(model, device, b, 5, plan.curves.contexts[0]) for b in plan.graph_batches]
    result["scheduler"] = M.scheduler_probe(model, device, shape.vocab)
    s = result["scheduler"]
    say(f"  one-token forward: {_ms(s.get('fixed_length_s'))} at a fixed length, {_ms(s.get('growing_length_s'))} "
        f"growing ({_ms(s.get('growing_length_cudnn_s'))} with cuDNN attention), "
        f"{_ms(s.get('scheduler_forward_s'))} through the scheduler ({_ms(s.get('scheduler_wall_s'))} "
        f"handed in to answer){' ' + s['error'] if 'error' in s else ''}")
    if "growing_length_graphs_s" in s:
        error = f" {s['error_graphs']}" if "error_graphs" in s else ""
        say(f"  from CUDA graphs ({s.get('graph_captures')} captured): {_ms(s.get('growing_length_graphs_s'))} "
            f"growing, {_ms(s.get('scheduler_forward_graphs_s'))} through the scheduler "
            f"({_ms(s.get('scheduler_wall_graphs_s'))} handed in to answer){error}")
    save()
    model_dir = workdir / name
    result["checkpoint"] = models.save(model, shape, model_dir)
    tokenizer = models.tokenizer(shape.vocab)
    del model
    _free(device)
    say(f"  saved in {result['checkpoint']['seconds']:.1f} s; capacity until the budget's share")
    result["capacity"] = {}
    C.run(model_dir, tokenizer, plan.device, plan.dtype, prompts, alone, plan.capacity, deadline, say,
          on_cell=save, out=result["capacity"])
    shutil.rmtree(model_dir, ignore_errors=True)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3g} ms"


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def model_goals(m: dict, floor_s: float | None) -> dict:
    """The issue's per-forward goals from a model's curves (context 256, slots)."""
    slots = m.get("cost", {}).get("slots", {})
    curve = slots.get(256) or slots.get("256") or next(iter(slots.values()), {})
    by_b = curve.get("BxL", {}).get(5) or curve.get("BxL", {}).get("5") or {}
    by_b = {int(b): seconds for b, seconds in by_b.items()}  # str keys once read back from the JSON
    one, many = by_b.get(1), by_b.get(32)
    # What a CUDA edge serves: the same forwards replayed from graphs (the graph probe), where their
    # logits matched the eager ones.
    graphs = {g["batch"]: g["graph_s"] for g in m.get("graphs") or [] if g.get("same_logits") and g.get("graph_s")}
    g_one, g_many = graphs.get(1), graphs.get(32)
    return {"one_5_token_forward_over_floor": {"value": one / floor_s if one and floor_s else None, "goal": GOAL_FLOOR},
            "32x5_over_1x5": {"value": many / one if one and many else None, "goal": GOAL_BATCH},
            "one_5_token_graph_over_floor": {"value": g_one / floor_s if g_one and floor_s else None,
                                             "goal": GOAL_FLOOR},
            "32x5_over_1x5_graphs": {"value": g_many / g_one if g_one and g_many else None, "goal": GOAL_BATCH},
            **{f"capacity_{k}": v for k, v in m.get("capacity", {}).get("goals", {}).items()}}


# ---------------------------------------------------------------------------------- main
def machine(plan: Plan) -> dict:
    import google.protobuf
    import grpc
    import transformers
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "grpcio": grpc.__version__, "protobuf": google.protobuf.__version__, "cpus": os.cpu_count()}
    if plan.device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device_name=p.name, device_memory_bytes=p.total_memory, cuda=torch.version.cuda,
                   multiprocessors=p.multi_processor_count)
    else:
        out["device_name"] = "cpu"
    return out


def parse_args(argv=None):
    from specdec.common.runtime import OneLineParser
    p = OneLineParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU (the default suite runs it)")
    p.add_argument("--out", type=Path, help="output directory (default: $OUT, else results/gpu_check/<timestamp>)")
    p.add_argument("--models", help=f"comma-separated, from {', '.join(models.SHAPES)}")
    p.add_argument("--budget-s", type=float, help="stop starting new work after this many seconds")
    p.add_argument("--skip-tests", action="store_true", help="skip (a)'s test tier")
    p.add_argument("--ns", help="device counts for the capacity cells, in the order measured")
    p.add_argument("--tokens", type=int, help="tokens per capacity session")
    p.add_argument("--draft-ms", type=float, help="replayed devices' drafting time per token")
    p.add_argument("--edge-args", help="extra edge-server flags for the capacity cells, one string "
                   "(the A/B's other arm: --edge-args='--cuda-graphs off')")
    p.add_argument("--variant-args", help="an A/B in one run: a second batched edge with these flags more "
                   "(one string), its batched and edge-only cells beside the first's at each N "
                   "(--variant-args='--verify-overlap off')")
    return p, p.parse_args(argv)


def plan_from(p, a) -> Plan:
    plan = SMOKE if a.cpu_smoke else GPU
    try:
        if a.models:
            names = tuple(x for x in a.models.split(",") if x)
            unknown = [x for x in names if x not in models.SHAPES]
            if unknown:
                raise ValueError(f"unknown models {unknown}; known: {', '.join(models.SHAPES)}")
            plan = replace(plan, models=names)
        cap = plan.capacity
        if a.ns:
            cap = replace(cap, ns=tuple(int(x) for x in a.ns.split(",")))
        if a.tokens:
            cap = replace(cap, tokens=a.tokens)
        if a.draft_ms is not None:
            cap = replace(cap, draft_ms=a.draft_ms)
        if a.edge_args:
            cap = replace(cap, edge_args=cap.edge_args + tuple(shlex.split(a.edge_args)))
        if a.variant_args is not None:
            cap = replace(cap, variant_args=tuple(shlex.split(a.variant_args)))
        plan = replace(plan, capacity=cap, budget_s=a.budget_s or plan.budget_s)
    except ValueError as exc:
        p.error(str(exc))
    if plan.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here: run it on a GPU machine, or --cpu-smoke")
    return plan


def out_dir(a, stamp: str) -> Path:
    path = a.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS / stamp)
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv=None) -> int:
    p, a = parse_args(argv)
    plan = plan_from(p, a)
    start = time.perf_counter()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = out_dir(a, stamp)
    data = {"started": stamp, "settings": plan.to_json(), "machine": machine(plan), "models": [], "timing": {}}

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {line}", flush=True)

    def write() -> None:
        data["timing"]["total_s"] = time.perf_counter() - start
        (out / "gpu_check.json").write_text(json.dumps(data, indent=1, default=str))

    say(f"gpu-check {'CPU smoke' if plan.smoke else 'GPU'} on {data['machine']['device_name']}: "
        f"models {list(plan.models)}, budget {plan.budget_s:.0f} s, results in {out}")
    if a.skip_tests or plan.smoke:  # the default suite imports tests/gpu (and deselects them) already
        data["tests"] = {"skipped": "--skip-tests" if a.skip_tests else "CPU smoke run"}
    else:
        data["tests"] = run_tests(plan)
    say(f"gpu tests: {data['tests'].get('summary', data['tests'].get('skipped'))}")
    data["bandwidth"] = M.bandwidth(torch.device(plan.device), plan.bandwidth_bytes)
    say(f"device-to-device copy: {data['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s (read + written)")
    write()
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check_", dir=_scratch()))
    try:
        for i, name in enumerate(plan.models):
            left = plan.budget_s - (time.perf_counter() - start)
            weights = [MODEL_WEIGHT.get(n, 1.0) for n in plan.models[i:]]
            deadline = time.perf_counter() + max(0.0, left) * weights[0] / sum(weights)
            m = {"name": name}
            data["models"].append(m)
            if left <= 0:
                m["skipped"] = "time budget"
                continue
            try:
                measure_model(m, plan, deadline, workdir, say, write)
            except Exception as exc:  # noqa: BLE001 - one model's failure is a finding; the others run
                m["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                say(f"{name} failed: {m['error']}")
                _free(torch.device(plan.device))
            m["floor_s"] = m.get("weight_bytes", 0) / data["bandwidth"]["bytes_per_s"] or None
            m["goals"] = model_goals(m, m["floor_s"])
            write()
            figure(data, out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    write()
    summary(data, say)
    say(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.png'}")
    return 0


def _scratch() -> str | None:
    """Checkpoints go to memory (/dev/shm) where it has room for the 8B model's 16 GB, else /tmp."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 40 << 30:
        return str(shm)
    return None


def figure(data: dict, out: Path) -> None:
    try:
        from specdec.bench.gpucheck import plots
        plots.figure(data, out / "gpu_check.png")
    except Exception as exc:  # noqa: BLE001 - the JSON holds every number; say why the figure is missing
        data.setdefault("errors", []).append(f"figure: {type(exc).__name__}: {exc}")


def summary(data: dict, say) -> None:
    for m in data["models"]:
        if "goals" not in m:
            say(f"{m['name']}: {m.get('skipped') or m.get('error')}")
            continue
        say(f"{m['name']}: floor {_fmt(m.get('floor_s'), 1e3)} ms; greedy margin >= "
            f"{_fmt(m.get('greedy', {}).get('min_relative_margin'))}; identity "
            f"{m.get('capacity', {}).get('identity')}; divergences "
            f"{sum(c.get('divergences', 0) for c in m.get('capacity', {}).get('cells', []))}")
        for key, g in m["goals"].items():
            if isinstance(g, dict) and "goal" in g:
                v, goal = g["value"], g["goal"]
                ok = None if v is None else (v <= goal if "over_floor" in key or "32x5" in key else v >= goal)
                say(f"  [{'n/a' if ok is None else 'PASS' if ok else 'MISS'}] {key}: {_fmt(v)} (goal {goal})")
        for n, ratios in m.get("capacity", {}).get("over_variant", {}).items():
            say(f"  A/B at N = {n}, tok/s over the variant's ({' '.join(m['capacity']['settings']['variant_args'])}): "
                + ", ".join(f"{k} {_fmt(v)}" for k, v in ratios.items()))

        for layout, d in m.get("phases", {}).items():
            say(f"  verification of one batched round ({layout}), ms batched / per session on the device / "
                "on the host: " + "; ".join(
                    f"T = {t} " + " / ".join(_fmt(d.get(f"verify_{place}_T{t}"), 1e3)
                                             for place in ("batched", "device", "host")) for t in (0, 1)))
            say(f"  gumbel T = 1 ({layout}), ms verified with the noise / noise drawn ahead + what is left: "
                f"{_fmt(d.get('verify_batched_gumbel_T1'), 1e3)} / {_fmt(d.get('noise_ahead_draws_gumbel_T1'), 1e3)}"
                f" + {_fmt(d.get('verify_batched_gumbel_T1_noise_ahead'), 1e3)}")


def _fmt(x, scale: float = 1.0) -> str:
    return "n/a" if x is None else f"{x * scale:.3g}"


if __name__ == "__main__":
    sys.exit(main())
