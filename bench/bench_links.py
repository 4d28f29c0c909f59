"""bench-links: the pair over emulated real links, edge-only vs fixed configurations vs ``mode auto``
(issue 18, item 4).

    make bench-links                       # full run (~90 min on 2 shared cores; prints its estimate)
    make bench-links ARGS=--quick          # a few minutes: 2 rates x 2 RTTs + 1 loss cell, T = 1, 32 tokens
    .venv/bin/python -m specdec.bench.bench_links [--quick] [--only-cells 10mbit,2mbit-20ms] [--configs none,auto,...]
        [--prompts N] [--max-new-tokens N] [--temperatures 0,1] [--no-changing] [--replot DIR]

Needs root (network namespaces, tc). One edge-server and one device driver for the whole run, in two
namespaces (the harness rig's "emulated" link, bench/harness/rig.py): tbf for the rate on both veth egresses
(downlink = plan.DOWN_FACTOR x uplink), the userspace emulator (testbed/linkemu.py) for the round
trip (one-way delay RTT / 2 each way), jitter and loss in both directions. Cells: uplink rate x RTT,
plus jitter / loss variants, at each temperature; per cell edge-only (mode none), the fixed
configurations and auto, interleaved on the same prompts and seeds (bench/links/plan.py). Then the
changing link: each configuration runs back-to-back sessions while the emulator (rate, delay and all,
tbf off) switches 100 Mbit/s 5 ms -> 1 Mbit/s 100 ms -> back at set seconds, live, the gRPC channel
staying up. ``mode auto`` runs where the device has it (common/settings.AUTO); until then its cells
say n/a.

Writes results/bench_links/<timestamp>/ (and results/bench_links/latest): bench_links.json (every
session record, per-cell tokens/s and ratios, the changing link's phases and rounds-to-recover, the
five goals), heatmap_T*.png (auto / best fixed and auto / edge-only over rate x RTT; best fixed /
edge-only and default / best fixed beside them), changing_T*.png (tokens/s over time, auto's
choices), logs/. Prints a summary table and the goals with PASS / MISS.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from specdec.bench import bench_law
from specdec.bench.harness import plan as harness_plan  # noqa: E402
from specdec.bench.harness.analyze import fmt, print_goals  # noqa: E402
from specdec.bench.harness.rig import Rig, shaping_available  # noqa: E402
from specdec.bench.links import analyze, plan  # noqa: E402

RESULTS = harness_plan.RESULTS / "bench_links"
STARTUP_S = 150.0        # namespaces, edge-server (dequantizes the GGUF target), driver load + warm-up
CHANGE_TAIL_S = 6.0      # a changing-link run's last session goes on past its window to its end
# Full-run estimate before any timing: ~14 tokens/s averaged over the grid's configs and cells (the
# issue's 10 Mbit/s figures, 17-34 tokens/s, and edge-only ~21, less for the slow and far cells).
DEFAULT_S_PER_TOKEN = 0.07
WARMUP_TOKENS = 8        # one short untimed session per config first (the edge's first edge-only round)


# ----------------------------------------------------------------------------- environment
def auto_support() -> dict:
    """Whether the device has ``mode auto`` and the ``round_log`` flag yet (being added in parallel)."""
    out = {"auto": False, "round_log": False}
    try:
        from specdec.common import settings as S
        out["auto"] = getattr(S, "AUTO", None) == "auto"
    except Exception as exc:  # pragma: no cover - reported, not fatal
        out["error"] = repr(exc)
    try:
        from specdec.device.factory import DeviceConfig
        out["round_log"] = "round_log" in {f.name for f in fields(DeviceConfig)}
    except Exception as exc:  # pragma: no cover
        out["error"] = repr(exc)
    return out


def set_link(rig: Rig, link: plan.Link, emulator_rate: bool = False) -> None:
    """tbf at the link's rates (or none, when the emulator carries the rate), then the emulator."""
    if emulator_rate:
        rig.set_rates(0.0, 0.0)
    else:
        rig.set_rates(link.up_bps, link.down_bps)
    rig.set_emulator(link.emulator(with_rate=emulator_rate))


# ----------------------------------------------------------------------------- the run
class Run:
    def __init__(self, s: plan.Settings, configs: list[str], extra: dict[str, dict], out: Path):
        self.s, self.configs, self.extra, self.out = s, configs, extra, out
        n = max(s.prompts, s.change_prompts)
        self.prompts = harness_plan.sample_texts(n)
        self.sessions: list[dict] = []
        self.errors: list[dict] = []
        self.cells: dict[str, dict] = {}
        self.changing: dict[str, dict] = {}
        self.timing: dict[str, float] = {}

    def _collect(self, rig, jobs: list[dict], meta: dict[str, dict]) -> list[dict]:
        got = []

        def on_line(line: dict) -> None:
            if "record" in line:
                m = meta[line["job"]]
                entry = {**m, "prompt": m["prompt"] + line["prompt"], "seed": line["seed"],
                         "record": line["record"], "extra": line["extra"]}
                got.append(entry)
                st = line["record"]["stats"]
                print(f"  {m['cell']:<28} {m['config']:<12} p{entry['prompt']} {st['generated_tokens']:>4} tok "
                      f"{st['wall_seconds']:6.2f} s {st['tokens_per_second']:6.1f} tok/s", flush=True)
            elif "error" in line:
                self.errors.append({**meta.get(line["job"], {}), **line})
                print(f"  ERROR {line['job']}: {line['error']}", flush=True)
        rig.run(jobs, on_line)
        return got

    def warm_up(self, rig) -> None:
        """One short untimed session per configuration, so no cell pays a first-use cost."""
        temp = self.s.temperatures[0]
        jobs = [plan.Job(f"warmup|{name}", "warmup", name, 0, temp, WARMUP_TOKENS,
                         plan.config_device(name, self.extra.get(name))).to_driver(self.prompts)
                for name in self.configs]
        rig.run(jobs, lambda line: self.errors.append(line) if "error" in line else None)

    def grid(self, rig) -> None:
        bytes_per_token: dict[float, dict[str, float]] = {}
        edge_tps: dict[float, float] = {}
        for link in plan.links(self.s):
            t_link = time.perf_counter()
            set_link(rig, link)
            for temp in self.s.temperatures:
                cell = plan.cell_name(link.name, temp)
                configs, pruned = plan.prune(self.configs, link.up_bps, bytes_per_token.get(temp, {}),
                                             edge_tps.get(temp))
                jobs = plan.cell_jobs(link.name, temp, configs, self.s.prompts, self.s.max_new_tokens, self.extra)
                meta = {j.id: {"cell": cell, "link": link.name, "temperature": temp, "config": j.config,
                               "prompt": j.prompt, "kind": "grid"} for j in jobs}
                print(f"[{link.name} T={temp:g}] {len(jobs)} sessions"
                      + (f"; pruned {', '.join(pruned)}" if pruned else ""), flush=True)
                got = self._collect(rig, [j.to_driver(self.prompts) for j in jobs], meta)
                self.sessions += got
                stats = analyze.config_stats(got)
                self.cells[cell] = {"link": asdict(link), "temperature": temp, "stats": stats,
                                    "summary": analyze.cell_summary(stats), "pruned": pruned}
                for name, v in stats.items():
                    if v["up_bytes_per_token"]:
                        bytes_per_token.setdefault(temp, {})[name] = v["up_bytes_per_token"]
                if "none" in stats:
                    edge_tps[temp] = stats["none"]["tps"]
            self.timing[link.name] = time.perf_counter() - t_link

    def changing_link(self, rig) -> None:
        phases = plan.changing_phases(self.s)
        for temp in self.s.temperatures:
            runs = {}
            for i, name in enumerate(self.configs):
                set_link(rig, phases[0].link, emulator_rate=True)
                job = plan.Job(f"changing@T{temp:g}|{name}", f"changing@T{temp:g}", name, 0, temp,
                               self.s.change_max_new_tokens, plan.config_device(name, self.extra.get(name)))
                changes: list[float] = []
                stop = threading.Event()

                def schedule(t0: float) -> None:
                    for ph in phases[1:]:
                        if stop.wait(max(0.0, t0 + ph.at_s - time.time())):
                            return
                        rig.set_emulator(ph.link.emulator(with_rate=True))
                        changes.append(time.time())

                meta = {job.id: {"cell": job.cell, "link": "changing", "temperature": temp, "config": name,
                                 "prompt": 0, "kind": "changing"}}
                t0 = time.time()
                changes.append(t0)
                th = threading.Thread(target=schedule, args=(t0,), daemon=True)
                th.start()
                print(f"[changing T={temp:g}] {name}", flush=True)
                try:
                    got = self._collect(rig, [job.to_driver(self.prompts, budget_s=self.s.change_end_s,
                                                            count=self.s.change_prompts)], meta)
                finally:
                    stop.set()
                    th.join()
                self.sessions += got
                timeline = [r for g in got for r in g["extra"]["timeline"]]
                auto_rounds = [r for g in got for r in (g["record"].get("rounds") or [])]
                last = max((g["extra"]["session_t1"] for g in got), default=t0)
                runs[name] = {"changes": changes, "end": min(t0 + self.s.change_end_s, last), "timeline": timeline,
                              "record_rounds": auto_rounds}
            self.changing[f"T{temp:g}"] = {"temperature": temp, "runs": runs,
                                           "summary": analyze.changing_summary(runs)}
        set_link(rig, phases[0].link, emulator_rate=True)


# ----------------------------------------------------------------------------- reporting
def print_table(data: dict) -> None:
    configs = data["configs"]
    print("\ntokens/s per cell (total tokens / total wall over the cell's sessions)")
    head = f"{'cell':<30}" + "".join(f"{c:>11}" for c in configs) + f"  {'best fixed':<12}{'auto/best':>10}" \
        f"{'auto/none':>10}{'auto/dflt':>10}{'best/none':>10}  auto/best 90% over prompts"
    print(head)
    for name, c in data["cells"].items():
        s = c["summary"]
        row = f"{name:<30}" + "".join(f"{fmt(s['tps'].get(k), '.1f'):>11}" for k in configs)
        iv = s.get("auto_vs_best_fixed_interval")
        row += f"  {s['best_fixed'] or '-':<12}{fmt(s['auto_vs_best_fixed']):>10}{fmt(s['auto_vs_edge_only']):>10}" \
               f"{fmt(s['auto_vs_default']):>10}{fmt(s['best_fixed_vs_edge_only']):>10}" \
               + (f"  [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else "")
        print(row)
    for label, ch in data["changing"].items():
        sm = ch["summary"]
        print(f"\nchanging link {label}: tokens/s per phase (100 Mbit 5 ms | 1 Mbit 100 ms | 100 Mbit 5 ms)")
        for name, v in sm["phase_tps"].items():
            print(f"  {name:<12}" + "".join(f"{fmt(x, '.1f'):>9}" for x in v))
        print("  best      " + "".join(f"{(b['config'] or '-'):>13}" for b in sm["phase_best"]))
        for r in sm["recover"]:
            print(f"  change {r['change']}: auto recovers in {r['rounds_to_recover']} rounds "
                  f"(target {fmt(r['target_tps'], '.1f')} tok/s, auto {fmt(r['auto_tps'], '.1f')} tok/s over the phase)")


def goal_detail(g: dict) -> str | None:
    """The line under the every-cell goal: which cells miss it even at the top of their interval."""
    if "below_even_at_interval_top" not in g:
        return None
    return (f"below it even at the top of the 90 % interval over prompts: "
            f"{', '.join(g['below_even_at_interval_top']) or 'none'}; below it but within the "
            f"interval: {', '.join(g['below_but_within_interval']) or 'none'}")


def analyze_all(data: dict) -> dict:
    by_cell: dict[str, list[dict]] = {}
    for sess in data["sessions"]:
        by_cell.setdefault(sess["cell"], []).append(sess)
    for name, c in data["cells"].items():
        c["summary"] = analyze.cell_summary(c["stats"])
        c["summary"]["auto_vs_best_fixed_interval"] = analyze.auto_vs_best_interval(by_cell.get(name, []))
    for ch in data["changing"].values():
        ch["summary"] = analyze.changing_summary(ch["runs"])
    data["goals"] = analyze.goals(data["cells"], {k: v["summary"] for k, v in data["changing"].items()})
    return data


def make_plots(data: dict, out: Path) -> list[str]:
    from specdec.bench.links import plots
    note = (f"bench-links {data['started']}, {data['settings']['prompts']} prompt(s) x "
            f"{data['settings']['max_new_tokens']} tokens per config and cell; rev {data['git']['revision'][:10]}")
    paths = []
    for temp in data["settings"]["temperatures"]:
        p = plots.heatmaps(data["cells"], temp, [("auto_vs_best_fixed", "auto / best fixed"),
                                                 ("auto_vs_edge_only", "auto / edge-only"),
                                                 ("best_fixed_vs_edge_only", "best fixed / edge-only"),
                                                 ("default_vs_best_fixed", "default / best fixed")],
                           out / f"heatmap_T{temp:g}.png", note)
        if p:
            paths.append(p.name)
    for label, ch in data["changing"].items():
        p = plots.changing_series(ch["runs"], ch["summary"], ch["temperature"], out / f"changing_{label}.png",
                                  analyze.token_events, note=note)
        if p:
            paths.append(p.name)
    return paths


def estimate_full(data: dict, setup_s: float) -> dict:
    """Full-run minutes from this run's seconds per generated token over the grid sessions."""
    grid = [x for x in data["sessions"] if x["kind"] == "grid"]
    tokens = sum(x["record"]["stats"]["generated_tokens"] for x in grid)
    wall = sum(x["record"]["stats"]["wall_seconds"] for x in grid)
    s_per_token = wall / tokens if tokens else DEFAULT_S_PER_TOKEN
    return full_estimate(s_per_token, setup_s)


def full_estimate(s_per_token: float, setup_s: float = STARTUP_S) -> dict:
    full = plan.Settings()
    p = plan.planned_sessions(full)
    grid_s = p["tokens"] * s_per_token
    change_s = p["changing_runs"] * (full.change_end_s + CHANGE_TAIL_S)
    return {"s_per_token": s_per_token, "planned": p, "grid_min": grid_s / 60, "changing_min": change_s / 60,
            "total_min": (grid_s + change_s + setup_s) / 60}


def write(data: dict, out: Path) -> None:
    (out / "bench_links.json").write_text(json.dumps(data, indent=1, default=str))


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only-cells", default="", help="comma-separated link-name substrings, e.g. 10mbit,0.5mbit-150ms")
    p.add_argument("--configs", default="", help=f"comma-separated subset of {','.join(plan.CONFIGS)}")
    p.add_argument("--prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperatures", default="", help="e.g. 0,1")
    p.add_argument("--no-changing", action="store_true", help="skip the changing link")
    p.add_argument("--no-auto", action="store_true", help="leave auto out even where the device has it")
    p.add_argument("--json-schema", action="store_true",
                   help="every session's output under bench_law's JSON schema (the target law's grammar)")
    p.add_argument("--replot", type=Path, default=None, help="redo analysis and plots of a finished run's dir")
    return p.parse_args(argv)


def settings_from(a) -> plan.Settings:
    s = plan.Settings.preset(a.quick)
    kw = {}
    if a.only_cells:
        kw["only_cells"] = tuple(x for x in a.only_cells.split(",") if x)
    if a.configs:
        names = tuple(x for x in a.configs.split(",") if x)
        unknown = set(names) - set(plan.CONFIGS)
        if unknown:
            raise SystemExit(f"unknown configs {sorted(unknown)}; known: {', '.join(plan.CONFIGS)}")
        kw["configs"] = names
    if a.prompts:
        kw["prompts"] = a.prompts
    if a.max_new_tokens:
        kw["max_new_tokens"] = a.max_new_tokens
    if a.temperatures:
        kw["temperatures"] = tuple(float(x) for x in a.temperatures.split(","))
    if a.no_changing:
        kw["changing"] = False
    return replace(s, **kw)


def finish(data: dict, out: Path) -> None:
    analyze_all(data)
    data["plots"] = make_plots(data, out)
    write(data, out)
    print_table(data)
    print_goals("issue 18 goals", data["goals"], detail=goal_detail)
    if data.get("estimate_full"):
        e = data["estimate_full"]
        print(f"\nfull-run estimate from this run ({e['s_per_token'] * 1e3:.0f} ms per generated token): "
              f"{e['planned']['sessions']} grid sessions x {plan.Settings().max_new_tokens} tokens = "
              f"{e['grid_min']:.0f} min + changing link {e['changing_min']:.0f} min + start-up = "
              f"{e['total_min']:.0f} min")
    print(f"\nresults: {out}")


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.replot:
        data = json.loads((a.replot / "bench_links.json").read_text())
        finish(data, a.replot)
        return 0
    why = shaping_available()
    if why:
        print(f"bench-links needs the shaped testbed: {why}", file=sys.stderr)
        return 2
    s = settings_from(a)
    support = auto_support()
    configs = list(s.configs)
    skipped = {}
    if "auto" in configs and (a.no_auto or not support["auto"]):
        configs.remove("auto")
        skipped["auto"] = "--no-auto" if a.no_auto else "the device has no mode auto yet (common/settings.AUTO)"
    # every auto configuration logs its rounds (an A/B between two of them runs both alike)
    extra = {name: {"round_log": True} for name in configs if plan.CONFIGS[name][0] == "auto"} \
        if support["round_log"] else {}
    if a.json_schema:  # the same grammar in every configuration: what it does to each, auto included
        grammar = {"grammar": {"kind": "json_schema", "source": json.dumps(bench_law.SCHEMA)}}
        extra = {name: {**extra.get(name, {}), **grammar} for name in configs}
    stamp = harness_plan.stamp()
    out = harness_plan.run_dir(RESULTS, stamp + ("-quick" if s.quick else ""))

    p = plan.planned_sessions(replace(s, configs=tuple(configs)))
    print(f"bench-links {'quick' if s.quick else 'full'}: {p['cells']} cells x {len(configs)} configs x "
          f"{s.prompts} prompt(s) = {p['sessions']} sessions of {s.max_new_tokens} tokens, "
          f"+ changing link {p['changing_runs']} runs x ~{s.change_end_s + CHANGE_TAIL_S:.0f} s; "
          f"configs {', '.join(configs)}" + (f"; skipped {skipped}" if skipped else ""))
    if not s.quick:
        e = full_estimate(DEFAULT_S_PER_TOKEN)
        print(f"estimate (at {DEFAULT_S_PER_TOKEN * 1e3:.0f} ms per token, before pruning): ~{e['total_min']:.0f} min")
    run = Run(s, configs, extra, out)
    data = {"started": stamp, "settings": s.to_json(), "configs": configs, "skipped": skipped,
            "auto_support": support, "device_extra": extra, "down_factor": plan.DOWN_FACTOR,
            "machine": harness_plan.machine_info(), "git": harness_plan.git_info(), "cells": run.cells, "changing": run.changing,
            "sessions": run.sessions, "errors": run.errors, "timing": run.timing,
            "rate_via": {"grid": "tbf (both veth egresses)", "changing": "linkemu (rate and delay, tbf off)"}}
    t0 = time.perf_counter()
    try:
        with Rig(out / "logs", link="emulated") as rig:
            setup_s = time.perf_counter() - t0
            run.timing["setup"] = setup_s
            data["draft_model"] = rig.draft_model
            print(f"rig up in {setup_s:.0f} s (drafter {rig.draft_model})", flush=True)
            set_link(rig, plan.links(s)[0] if plan.links(s) else plan.changing_phases(s)[0].link)
            run.warm_up(rig)
            run.grid(rig)
            write(data, out)
            if s.changing:
                t_change = time.perf_counter()
                run.changing_link(rig)
                run.timing["changing"] = time.perf_counter() - t_change
    finally:
        run.timing["total"] = time.perf_counter() - t0
        data["machine"]["loadavg_end"] = list(os.getloadavg())
        write(data, out)
    if s.quick:
        data["estimate_full"] = estimate_full(data, run.timing.get("setup", STARTUP_S))
    finish(data, out)
    print(f"wall {run.timing['total'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
