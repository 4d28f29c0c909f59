"""Numbers from one run: per cell, per (temperature, N, mode), the goals, the replay's validation.
Pure: no I/O."""
from __future__ import annotations

import re
import statistics

from specdec.bench.harness.analyze import goal, mean, percentile, ratio

# The edge's batching histograms (issue 19 item 1), read from its /metrics before and after a cell.
BATCH_FAMILIES = ("specdec_edge_batch_sessions", "specdec_edge_batch_tokens", "specdec_edge_batch_queue_seconds",
                  "specdec_edge_batch_forward_seconds", "specdec_edge_batch_static_forwards",
                  "specdec_edge_batch_cuda_graph_forwards", "specdec_edge_batch_verify_seconds")
GRAPHS = "specdec_edge_batch_cuda_graph_forwards_total"  # by outcome (its label kept)
GOAL_N = 8                    # the goals are stated at 8 devices
GOAL_BATCHED_VS_UNBATCHED = 3.0
GOAL_BATCHED_VS_EDGE_ONLY = 2.0
GOAL_NEVER_BELOW_EDGE_ONLY = 0.97
GOAL_P95_KEEP = 0.40          # per-device p95 tokens/s at N = 8 vs N = 1
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """``{name: value}`` summed over label sets, for every sample of the batching families; the graph
    outcomes also by label (``{GRAPHS}{graph="replayed"}``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or not m.group(1).startswith(BATCH_FAMILIES):
            continue
        if m.group(1).endswith("_bucket"):
            continue
        try:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            if m.group(1) == GRAPHS and m.group(2):
                out[m.group(1) + m.group(2)] = float(m.group(3))
        except ValueError:
            pass
    return out


def batch_stats(before: dict | None, after: dict | None) -> dict:
    """Forwards and mean sessions / tokens per forward over a cell; ``available`` False where the edge
    has no batching metrics (an edge before batching, or no /metrics)."""
    if not before or not after or "specdec_edge_batch_sessions_count" not in after:
        return {"available": False}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    forwards = d.get("specdec_edge_batch_sessions_count", 0.0)
    if not forwards:  # an edge serving one session per forward (--no-batching) counts no batches
        return {"available": False}

    def mean(family: str):
        return d.get(f"{family}_sum", 0.0) / forwards if forwards else None
    return {"available": True, "forwards": forwards, "mean_sessions": mean("specdec_edge_batch_sessions"),
            "mean_tokens": mean("specdec_edge_batch_tokens"),
            "mean_queue_s": _family_mean(d, "specdec_edge_batch_queue_seconds"),
            "mean_forward_s": _family_mean(d, "specdec_edge_batch_forward_seconds"),
            # the scheduler thread's verification after each forward with rounds in it
            "verify_s": d.get("specdec_edge_batch_verify_seconds_sum", 0.0),
            "static_forwards": d.get("specdec_edge_batch_static_forwards_total", 0.0),
            "graphs": {o: d.get(f'{GRAPHS}{{graph="{o}"}}', 0.0) for o in ("captured", "replayed", "failed")}}


def _family_mean(d: dict, family: str):
    n = d.get(f"{family}_count", 0.0)
    return d.get(f"{family}_sum", 0.0) / n if n else None


def cell_stats(sessions: list[dict], n: int, full_tokens: int | None = None) -> dict:
    """One cell: ``sessions`` as replay.SessionResult.to_json (times from the cell's start).

    Aggregate tokens/s counts the tokens delivered while all ``n`` clients were still busy: up to the
    first last token of a client whose sessions ran their whole ``full_tokens`` (a prompt whose
    answer ends early at EOS does not cut everyone's window short), so a cell's straggling tail does
    not dilute it; the makespan rate (all tokens / last token) is kept beside it. Per-device p95 is
    the tail: the 95th percentile of seconds per token, as tokens/s (= the 5th percentile of
    per-session tokens/s)."""
    ok = [s for s in sessions if not s["error"]]
    ends: dict[int, float] = {}
    short: set[int] = set()
    for s in ok:
        ends[s["client"]] = max(ends.get(s["client"], 0.0), s["t_end"])
        if full_tokens is not None and s["tokens"] < full_tokens:
            short.add(s["client"])
    full = [t for c, t in ends.items() if c not in short] or list(ends.values())
    window = min(full) if len(ends) == n else None
    events = [(t, k) for s in ok for t, k in s["events"]]
    in_window = sum(k for t, k in events if window is not None and t <= window)
    last = max((s["t_end"] for s in ok), default=0.0)
    total = sum(k for _, k in events)
    tps = [s["tokens_per_s"] for s in ok if s["tokens"] and not s["divergence"]]
    ttft = [s["ttft_s"] for s in ok if s["ttft_s"] is not None]
    return {"n": n, "sessions": len(sessions), "errors": len(sessions) - len(ok),
            "divergences": sum(1 for s in ok if s["divergence"]),
            "tokens": total, "aggregate_tps": in_window / window if window else None,
            "makespan_tps": total / last if last > 0 else None, "window_s": window, "makespan_s": last,
            "per_device_p50": percentile(tps, 50), "per_device_p95": percentile(tps, 5),
            "per_device_mean": statistics.fmean(tps) if tps else None,
            "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
            "acceptance": _acceptance(ok), **hint_stats(ok)}


def hint_stats(sessions: list[dict]) -> dict:
    """The edge's load-aware advice over the rounds: how often it came, its mean, how often it was 0."""
    hints = [h for s in sessions for h in s.get("hints", [])]
    given = [h for h in hints if h is not None]
    return {"rounds": len(hints), "hinted_rounds": len(given),
            "mean_hint": statistics.fmean(given) if given else None,
            "zero_hints": sum(1 for h in given if h == 0),
            "hints_not_followed": sum(s.get("hints_not_followed", 0) for s in sessions)}


def _acceptance(sessions: list[dict]):
    drafted = sum(s["drafted"] for s in sessions)
    return sum(s["accepted"] for s in sessions) / drafted if drafted else None


def combine(cells: list[dict]) -> dict:
    """Repeats of one (temperature, N, mode): means of the rates, the sessions' percentiles pooled."""
    sessions = [s for c in cells for s in c["sessions"]]
    pooled = cell_stats_pooled(sessions)
    agg = [c["stats"]["aggregate_tps"] for c in cells if c["stats"]["aggregate_tps"]]
    batch = [c["batch"] for c in cells if c["batch"].get("available")]
    return {**pooled, "aggregate_tps": statistics.fmean(agg) if agg else None,
            "aggregate_tps_repeats": agg, "repeats": len(cells),
            "makespan_tps": mean([c["stats"]["makespan_tps"] for c in cells]),
            "errors": sum(c["stats"]["errors"] for c in cells),
            "divergences": sum(c["stats"]["divergences"] for c in cells),
            "batch": _combine_batch(batch)}


def cell_stats_pooled(sessions: list[dict]) -> dict:
    ok = [s for s in sessions if not s["error"]]
    tps = [s["tokens_per_s"] for s in ok if s["tokens"] and not s["divergence"]]
    ttft = [s["ttft_s"] for s in ok if s["ttft_s"] is not None]
    return {"per_device_p50": percentile(tps, 50), "per_device_p95": percentile(tps, 5),
            "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95), "acceptance": _acceptance(ok),
            "sessions": len(sessions), **hint_stats(ok)}


def _combine_batch(batch: list[dict]) -> dict:
    if not batch:
        return {"available": False}
    fw = sum(b["forwards"] for b in batch)

    def weighted(key):
        xs = [(b[key], b["forwards"]) for b in batch if b.get(key) is not None]
        w = sum(f for _, f in xs)
        return sum(x * f for x, f in xs) / w if w else None
    return {"available": True, "forwards": fw, "mean_sessions": weighted("mean_sessions"),
            "mean_tokens": weighted("mean_tokens"), "mean_queue_s": weighted("mean_queue_s"),
            "mean_forward_s": weighted("mean_forward_s")}


def summary(cells: list[dict]) -> dict:
    """``{"T0": {"batched": {"1": combined, ...}, ...}}`` from every measured cell."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["temperature"], c["mode"], c["n"]), []).append(c)
    out: dict[str, dict] = {}
    for (temp, mode, n), cs in sorted(groups.items()):
        out.setdefault(f"T{temp:g}", {}).setdefault(mode, {})[str(n)] = combine(cs)
    return out


def _get(table: dict, mode: str, n: int, key: str):
    return table.get(mode, {}).get(str(n), {}).get(key)


def goals(summ: dict) -> dict:
    """The issue's four goals per temperature, PASS/MISS from ratios measured in this run (None = n/a)."""
    out = {}
    for label, table in summ.items():
        b8 = _get(table, "batched", GOAL_N, "aggregate_tps")
        ratios_eo = {n: ratio(_get(table, "batched", int(n), "aggregate_tps"),
                             _get(table, "edge-only", int(n), "aggregate_tps"))
                     for n in table.get("batched", {})}
        ratios_eo = {n: r for n, r in ratios_eo.items() if r is not None}
        worst = min(ratios_eo.items(), key=lambda kv: kv[1]) if ratios_eo else (None, None)
        p95 = ratio(_get(table, "batched", GOAL_N, "per_device_p95"), _get(table, "batched", 1, "per_device_p95"))
        out[label] = {
            "batched_vs_unbatched_N8": goal(f"batched aggregate >= {GOAL_BATCHED_VS_UNBATCHED:g}x unbatched at N = 8",
                                             ratio(b8, _get(table, "unbatched", GOAL_N, "aggregate_tps")),
                                             GOAL_BATCHED_VS_UNBATCHED),
            "batched_vs_edge_only_N8": goal(f"batched aggregate >= {GOAL_BATCHED_VS_EDGE_ONLY:g}x edge-only at N = 8",
                                             ratio(b8, _get(table, "edge-only", GOAL_N, "aggregate_tps")),
                                             GOAL_BATCHED_VS_EDGE_ONLY),
            "never_below_edge_only": goal(f"batched >= {GOAL_NEVER_BELOW_EDGE_ONLY:g}x edge-only at every N",
                                           worst[1], GOAL_NEVER_BELOW_EDGE_ONLY, where=f"worst at N = {worst[0]}",
                                           detail={n: r for n, r in ratios_eo.items()}),
            "p95_N8_vs_N1": goal(f"per-device p95 tokens/s at N = 8 >= {GOAL_P95_KEEP:.0%} of N = 1 (batched)",
                                  p95, GOAL_P95_KEEP),
        }
    return out


def real_step_s(records: list[dict]) -> float | None:
    """A real device's mean drafting step (forward, sampling, encoding) over its sessions' records:
    drafting seconds / drafter forwards: tokens drafted, those drafted ahead and thrown away, and the
    forward that feeds the last draft before each round drafted ahead and used."""
    secs = sum(r["stats"]["time"]["draft"] + r["stats"]["time"]["encode"] for r in records)
    steps = sum(r["stats"]["draft_tokens"] + r["stats"]["draft_ahead"]["tokens_discarded"]
                + r["stats"]["draft_ahead"]["rounds_used"] for r in records)
    return secs / steps if steps else None


def validation(real: dict[int, list[dict]], replay: dict[int, list[dict]]) -> dict:
    """Replay vs real device-clients per N: mean per-session tokens/s, their ratio, and what explains
    a difference: the real devices' drafting step and the edge's seconds per round on both sides.

    ``real[n]``: the driver's session records (device-client --json); ``replay[n]``: replay sessions."""
    out = {}
    for n in sorted(set(real) & set(replay)):
        rs = real[n]
        ps = [x for x in replay[n] if not x["error"] and not x["divergence"]]
        r_tps = mean([x["stats"]["tokens_per_second"] for x in rs])
        p_tps = mean([x["tokens_per_s"] for x in ps])
        r_rounds = sum(x["stats"]["rounds"] for x in rs)
        p_rounds = sum(x["rounds"] for x in ps)
        out[str(n)] = {"real_tps_mean": r_tps, "replay_tps_mean": p_tps, "ratio": ratio(p_tps, r_tps),
                       "real_sessions": len(rs), "replay_sessions": len(ps),
                       "real_tokens": [x["stats"]["generated_tokens"] for x in rs], "replay_tokens": [x["tokens"] for x in ps],
                       "real_rounds": r_rounds, "replay_rounds": p_rounds,
                       "real_draft_ms_per_step": _ms(real_step_s(rs)),
                       "real_edge_ms_per_round": _ms(ratio(sum(x["stats"]["time"]["verify"] for x in rs), r_rounds)),
                       "replay_edge_ms_per_round": _ms(ratio(sum(x.get("edge_s", 0.0) for x in ps), p_rounds))}
    return out


def _ms(x):
    return x * 1e3 if isinstance(x, (int, float)) else None
