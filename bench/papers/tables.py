"""The run's tables, one function per figure, from its raw data (``raw.json``).

``d`` holds: settings, sessions (each with link, job, config, shape, role, prompt, record = the
device's JSON, extra = the driver's per-round log), jobs, blocks (link phases), baselines (per
rate-curve job: the target alone on its prompts right after it), ceilings, vocab_size.
"""
from __future__ import annotations

import math

from specdec.bench.harness.analyze import aggregate
from specdec.bench.papers import analyze, plan

MODE_ORDER = ["dense", "tslt", "ksqs", "csqs", "dssd"]


def settings_of(d: dict) -> plan.Settings:
    raw = dict(d["settings"])
    for k, v in raw.items():
        if isinstance(v, list):
            raw[k] = tuple(v)
    return plan.Settings(**raw)


def _median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x and math.isfinite(x))
    if not xs:
        return float("nan")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def target_tps(d: dict) -> float:
    """T_LLM's inverse for the model: the median target-alone tokens/s over the full-length baselines."""
    s = settings_of(d)
    return _median([b["tokens_per_second"] for jid, b in d["baselines"].items()
                    if d["jobs"][jid]["max_new_tokens"] == s.max_new_tokens])


def rate_curve(d: dict) -> list[dict]:
    """(3) Speedup per (link, config) on the rate-curve prompts, measured and predicted."""
    s, sessions = settings_of(d), d["sessions"]
    links = {b["link"]: b for b in d["blocks"]}
    grid = [j for j in d["jobs"].values() if j["role"] == "grid" and j["link"] in links]
    t_tps = target_tps(d)
    rows = []
    for j in grid:
        agg = aggregate(sessions, lambda x: x["job"] == j["id"])
        if not agg.sessions:
            continue
        # The model's parts pooled over every link of this config (the link only adds bits / rate).
        pooled = aggregate(sessions, lambda x: x["role"] == "grid" and x["config"] == j["config"]
                                   and x["shape"] == j["shape"])
        b = links[j["link"]]
        bl = d["baselines"].get(j["id"], {})
        base = bl.get("tokens_per_second", float("nan"))
        cpu = d.get("point_cpu", {}).get(j["id"], float("nan"))
        t_cpu = bl["cpu_seconds"] / bl["tokens"] if bl.get("tokens") else float("nan")  # target CPU s / token
        rows.append({"link": j["link"], "rate_mbit": b["rate_bps"] / 1e6, "config": j["config"],
                     "shape": j["shape"], "family": j["family"], "K": j["K"], "max_new_tokens": j["max_new_tokens"],
                     "reduced": j["reduced"], **agg.row(), "target_alone_tps": base,
                     "speedup": agg.tps / base if base else float("nan"),
                     "cpu_s_per_token": cpu / agg.tokens if agg.tokens else float("nan"),
                     "target_cpu_s_per_token": t_cpu,
                     "speedup_cpu": t_cpu * agg.tokens / cpu if cpu else float("nan"),
                     "predicted_speedup": analyze.predicted_speedup(
                         pooled, j["shape"], s.draft_len, s.tree, b["rate_bps"], b["down_rate_bps"], t_tps)})
    return sorted(rows, key=lambda r: (r["shape"], r["config"], -r["rate_mbit"] if r["rate_mbit"] else -1e9))


def loopback(d: dict) -> list[dict]:
    """(4) and the acceptance figures: every loopback config over all loopback prompts."""
    rows = []
    for j in d["jobs"].values():
        if j["link"] != "loopback" or j["role"] not in ("grid", "ksweep"):
            continue  # one row per config: its grid job stands for its grid-extra job too
        agg = aggregate(d["sessions"], lambda x: x["link"] == "loopback" and x["config"] == j["config"]
                                and x["shape"] == j["shape"] and x["role"] in ("grid", "grid-extra", "ksweep"))
        if agg.sessions:
            rows.append({"config": j["config"], "shape": j["shape"], "family": j["family"], "K": j["K"],
                         "role": j["role"], **agg.row()})
    order = lambda r: MODE_ORDER.index(r["family"]) if r["family"] in MODE_ORDER else 9  # noqa: E731
    return sorted(rows, key=lambda r: (r["shape"], order(r), r["K"] or 0))


def acceptance_vs_k(loop: list[dict], vocab: int) -> list[dict]:
    """(2) alpha-hat(K) next to |alpha-hat - alpha| <= E[sigma_K] (TSLT eq. 22); alpha = dense (K = |V|)."""
    out = []
    for shape in ("chain", "tree"):
        ref = next((r for r in loop if r["shape"] == shape and r["family"] == "dense"), None)
        for r in loop:
            if r["shape"] != shape or r["family"] not in ("tslt", "dense"):
                continue
            bound = r["sigma_mean"] if r["family"] == "tslt" else 0.0
            dev = abs(r["acceptance"] - ref["acceptance"]) if ref else float("nan")
            noise = 2 * math.hypot(r["acceptance_se"], ref["acceptance_se"]) if ref else float("nan")
            out.append({"shape": shape, "K": r["K"] if r["family"] == "tslt" else vocab,
                        "acceptance": r["acceptance"], "acceptance_se": r["acceptance_se"],
                        "draft_positions": r["draft_positions"], "sigma_mean": bound,
                        "ref_acceptance": ref["acceptance"] if ref else float("nan"), "abs_deviation": dev,
                        "within_bound": dev <= bound if math.isfinite(dev) else None,
                        "within_bound_plus_2se": dev <= bound + noise if math.isfinite(dev) else None})
    return sorted(out, key=lambda r: (r["shape"], r["K"]))


def topk_mass(d: dict, vocab: int) -> list[dict]:
    """(1) The drafter's top-K mass at every draft step of the dense loopback sessions (untruncated q)."""
    dense = [x for x in d["sessions"] if x["link"] == "loopback" and x["config"] == "dense"]
    grid = [vocab if k == plan.FULL_VOCAB_K else k for k in plan.TOPK_GRID]
    return [r for r in analyze.topk_mass_curve(dense, grid) if not vocab or r["K"] <= vocab]


def sqs(d: dict) -> list[dict]:
    """(5) K-SQS vs C-SQS per temperature: latency per token, resampling rate, draft length."""
    rows = []
    for j in d["jobs"].values():
        if j["role"] != "sqs":
            continue
        agg = aggregate(d["sessions"], lambda x: x["job"] == j["id"])
        if agg.sessions:
            mode, t = j["config"].split("@T")
            rows.append({"mode": mode, "temperature": float(t), "link": j["link"], **agg.row(),
                         "seconds_per_token": agg.wall / agg.tokens if agg.tokens else float("nan"),
                         "seconds_per_session": agg.wall / agg.sessions,
                         "draft_len_mean": agg.positions / agg.rounds if agg.rounds else float("nan")})
    return sorted(rows, key=lambda r: (r["mode"], r["temperature"]))


def _tps(per_session: list, field: int = 1) -> float:
    """Tokens per second (field 1) or per CPU second (field 2) over (tokens, seconds, cpu) rows."""
    secs = sum(row[field] for row in per_session)
    return sum(row[0] for row in per_session) / secs if secs > 0 else float("nan")


def ceilings(d: dict, loop: list[dict], rc: list[dict]) -> dict:
    """(6) Ours on loopback (chain, all loopback prompts) against the target alone and HF assisted.

    ``ratio_to_assisted`` divides tokens/s measured minutes apart on shared cores; the
    ``..._normalized`` ratio divides speedups instead (ours: the loopback rate-curve point over its
    adjacent target-alone baseline; assisted: over the target alone measured right before it), so
    that drift of the cores' speed between the two cancels.
    """
    c = d.get("ceilings") or {}
    if not c:
        return {}
    t_tps = c["target"]["tokens_per_second"]
    a_tps = c["assisted"]["tokens_per_second"]
    n = settings_of(d).rate_prompts  # the speedups compare on the rate-curve prompts, like our point
    a_speedup = _tps(c["assisted"]["per_session"][:n]) / _tps(c["target"]["per_session"][:n])
    a_speedup_cpu = _tps(c["assisted"]["per_session"][:n], 2) / _tps(c["target"]["per_session"][:n], 2)
    loop_speedup = {r["config"]: r["speedup"] for r in rc if r["link"] == "loopback" and r["shape"] == "chain"}
    loop_cpu = {r["config"]: r["speedup_cpu"] for r in rc if r["link"] == "loopback" and r["shape"] == "chain"}
    ours = {r["config"]: {"tokens_per_s": r["tokens_per_s"], "family": r["family"], "acceptance": r["acceptance"],
                          "ratio_to_assisted": r["tokens_per_s"] / a_tps if a_tps else None,
                          "speedup_vs_target": loop_speedup.get(r["config"]),
                          "ratio_to_assisted_normalized": (loop_speedup.get(r["config"], float("nan")) / a_speedup
                                                           if a_speedup else None),
                          "speedup_cpu_vs_target": loop_cpu.get(r["config"]),
                          "ratio_to_assisted_cpu": (loop_cpu.get(r["config"], float("nan")) / a_speedup_cpu
                                                    if a_speedup_cpu else None)}
            for r in loop if r["shape"] == "chain" and r["role"] == "grid"}
    return {**c, "target_tps": t_tps, "assisted_tps": a_tps, "assisted_speedup": a_speedup,
            "assisted_speedup_cpu": a_speedup_cpu, "target_tps_run_median": target_tps(d), "ours": ours}


def build(d: dict) -> dict:
    vocab = d.get("vocab_size") or 0
    loop, rc = loopback(d), rate_curve(d)
    return {"rate_curve": rc, "loopback": loop, "acceptance_vs_k": acceptance_vs_k(loop, vocab),
            "topk_mass": topk_mass(d, vocab), "sqs": sqs(d), "ceilings": ceilings(d, loop, rc)}
