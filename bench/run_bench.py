"""Benchmarks that reproduce the papers' figures on real runs, with the zero-network ceilings beside them.

    make bench                  # full run (~30 min on 2 shared cores)
    make bench ARGS=--quick     # < 3 min: fewer links, prompts and tokens
    .venv/bin/python -m specdec.bench.run_bench [--quick] [--max-new-tokens N] [--rates 1,10] [--replot DIR]

One run on the embedded target (SmolLM2-135M-Instruct, edge-server's default) and the default drafter
(device-client's default), one torch thread per process, measures and writes under
results/<timestamp>/ (and points results/latest at it):
  1. top-K mass of the drafter's q vs K (TSLT Fig. 3)                    topk_mass.csv
  2. acceptance vs K, chain and tree, with |alpha-hat - alpha| <= E[sigma] (TSLT Fig. 4, eq. 22)
                                                                          acceptance_vs_k.csv
  3. speedup over the target alone vs uplink rate, every mode, chain and tree, through the shaped
     testbed, with the oracle-call model's prediction (TSLT Fig. 5-6)      rate_curve.csv
  4. uplink / downlink bytes per generated token per mode                 loopback.csv
  5. K-SQS vs C-SQS latency and resampling rate across temperatures (SQS Fig. 2)   sqs.csv
  6. ceilings: target alone and transformers assisted generation, same pair, prompts and seeds
     (assisted on the pair's two cores: ceilings.ASSISTED_THREADS threads)  ceilings.json
plus plots/*.png, sessions.jsonl (every session's device JSON), summary.json (machine, models,
settings, git revision, what was sampled, the spread of the repeated target-alone baselines = noise).
Shaped links need root (network namespaces, tc); without it the run keeps loopback only and says so.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import datetime as dt
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: the two cores are shared

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from specdec.bench.harness import plan as harness_plan  # noqa: E402
from specdec.bench.harness.rig import Rig, shaping_available  # noqa: E402
from specdec.bench.harness.analyze import aggregate, finite_or_none  # noqa: E402
from specdec.bench.papers import ceilings, plan, plots, tables  # noqa: E402

RESULTS = harness_plan.RESULTS


# ----------------------------------------------------------------------------- run metadata
def machine_info() -> dict:
    import transformers

    return {**harness_plan.machine_info(), "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads_per_process": 1}


# ----------------------------------------------------------------------------- the run
class Run:
    def __init__(self, s: plan.Settings, out: Path, shaped_ok: bool, no_shaping_reason: str | None):
        self.machine = machine_info()  # load average at the start: the shared cores' noise
        self.s = s
        self.out = out
        self.shaped_ok = shaped_ok
        self.no_shaping_reason = no_shaping_reason
        self.prompts = harness_plan.sample_texts(max(s.loop_prompts, s.rate_prompts, s.sqs_prompts))
        self.jobs: dict[str, plan.Job] = {}
        self.sessions: list[dict] = []
        self.errors: list[dict] = []
        self.blocks: list[dict] = []
        self.baselines: dict[str, dict] = {}  # job id -> the target alone right after that rate-curve point
        self.point_cpu: dict[str, float] = {}  # job id -> CPU seconds of edge + driver during that point
        self.ceil: dict = {}
        self.draft_model = ""
        self.t0 = time.perf_counter()
        # device sessions and target-alone baselines, plus the two ceilings
        total = plan.planned_sessions(s, shaped_ok) + 2 * s.loop_prompts
        self.bar = tqdm(total=total, unit="session", dynamic_ncols=True, smoothing=0.05)

    # -- target alone and assisted generation (this process) --------------------------------------
    def load_models(self):
        from specdec.common.modeling import ModelSpec, load_model
        from specdec.device.factory import DeviceConfig, choose_drafter

        self.bar.set_description("loading models")
        self.target = load_model(ModelSpec())
        self.drafter = load_model(choose_drafter(DeviceConfig()).spec)
        self.assistant = ceilings.as_assistant(self.drafter)
        if self.assistant is not None:
            ceilings.prepare_assistant(self.assistant, self.s.draft_len)
        self.bar.set_description("warm-up")
        ceilings.warm_up(self.target, self.prompts[0], self.s.temperature, self.assistant)

    def _decode(self, n: int, assistant=None) -> ceilings.DecodeStats:
        seeds = [harness_plan.SEED_BASE + i for i in range(n)]
        return ceilings.decode(self.target, self.prompts[:n], seeds, self.s.temperature, self.s.max_new_tokens,
                               assistant, on_done=lambda: self.bar.update(1))

    def baseline(self, job: plan.Job) -> None:
        """Target-alone tokens/s on a point's prompts, seeds and token count, right after the point."""
        st = ceilings.decode(self.target, [self.prompts[i] for i in job.prompts],
                             [harness_plan.SEED_BASE + i for i in job.prompts], self.s.temperature, job.max_new_tokens,
                             on_done=lambda: self.bar.update(1))
        self.baselines[job.id] = st.to_json()

    def measure_ceilings(self) -> None:
        self.bar.set_description("ceiling: target alone")
        alone = self._decode(self.s.loop_prompts)
        self.bar.set_description("ceiling: HF assisted generation")
        assisted, err = ceilings.DecodeStats(), f"{self.drafter.name} cannot be a transformers assistant"
        if self.assistant is not None:
            try:
                assisted = self._decode(self.s.loop_prompts, self.assistant)
                err = None
            except Exception as exc:  # e.g. a drafter transformers cannot use as an assistant
                assisted, err = ceilings.DecodeStats(), f"{type(exc).__name__}: {exc}"
        self.ceil = {"target": alone.to_json(), "assisted": assisted.to_json(), "assisted_error": err,
                     "assisted_threads": ceilings.ASSISTED_THREADS,
                     "draft_len": self.s.draft_len, "temperature": self.s.temperature,
                     "prompts": self.s.loop_prompts, "max_new_tokens": self.s.max_new_tokens}

    # -- link blocks --------------------------------------------------------------------------------
    def _on_line(self, link: str):
        def handle(line: dict) -> None:
            if "record" in line:
                job = self.jobs[line["job"]]
                self.sessions.append({"link": link, "job": line["job"], "config": job.config.name,
                                      "shape": job.config.shape, "role": job.role, "prompt": line["prompt"],
                                      "seed": line["seed"], "record": line["record"], "extra": line["extra"],
                                      "t": time.perf_counter() - self.t0})  # when it ended, for the baseline
                self.draft_model = line["record"].get("draft_model", self.draft_model)
                self.bar.update(1)
            elif "error" in line:
                self.errors.append({"link": link, **line})
                self.bar.update(1)
            elif line.get("done"):
                job = self.jobs[line["job"]]
                skipped = job.extra["planned_sessions"] - line["sessions"] - sum(
                    1 for e in self.errors if e.get("job") == line["job"])
                self.bar.update(max(0, skipped))
        return handle

    def _register(self, jobs: list[plan.Job]) -> list[dict]:
        for j in jobs:
            j.extra["planned_sessions"] = len(j.prompts)
            self.jobs[j.id] = j
        return [j.to_driver(self.prompts) for j in jobs]

    def run_links(self, rig: Rig) -> None:
        """Per link: each rate-curve point, then the target alone on its prompts; then the rest."""
        s = self.s
        sqs_on = plan.sqs_link(s, self.shaped_ok)
        self.draft_model = rig.draft_model
        for link in plan.links(s):
            if link.shaped and not self.shaped_ok:
                continue
            self.bar.set_description(f"link {link.name}")
            if link.shaped:
                points, rest = plan.shaped_jobs(s, link, self.loop_cost()), []
                self.bar.update(2 * sum(s.rate_prompts - len(j.prompts) for j in points))  # cut by reduction
            else:
                points, rest = plan.loopback_jobs(s)
            if link.name == sqs_on:
                rest += plan.sqs_jobs(s, link.name)
            t0 = time.perf_counter()
            err = None
            try:
                rig.set_rates(link.rate_bps, link.down_rate_bps)
                before = rig.wire_bytes()
                for job in points:
                    cpu0 = rig.cpu_seconds()
                    rig.run(self._register([job]), self._on_line(link.name))
                    self.point_cpu[job.id] = rig.cpu_seconds() - cpu0
                    self.baseline(job)  # the target alone right after, on the same prompts and seeds
                rig.run(self._register(rest), self._on_line(link.name))
                after = rig.wire_bytes()
            except Exception as exc:  # a broken link must not lose the others
                err, before, after = f"{type(exc).__name__}: {exc}", (None, None), (None, None)
                tqdm.write(f"link {link.name}: {err}")
            wire = [a - b if a is not None and b is not None and rate else None
                    for a, b, rate in zip(after, before, (link.rate_bps, link.down_rate_bps))]
            self.blocks.append({"link": link.name, "rate_bps": link.rate_bps, "down_rate_bps": link.down_rate_bps,
                                "seconds": time.perf_counter() - t0, "error": err, "shaper": rig.shaper,
                                "uplink_wire_bytes": wire[0], "downlink_wire_bytes": wire[1]})
            if err and "driver exited" in err:
                break

    def loop_cost(self) -> dict[str, dict]:
        """Per config: mean loopback seconds, rounds and uplink bits per rate-curve session."""
        out = {}
        for key in {j.config.key for j in self.jobs.values() if j.link == "loopback"}:
            agg = aggregate(self.sessions, lambda x: x["link"] == "loopback" and
                                    f"{x['config']}/{x['shape']}" == key and x["prompt"] < self.s.rate_prompts)
            if agg.sessions:
                out[key] = {"session_s": agg.wall / agg.sessions, "rounds": agg.rounds / agg.sessions,
                            "up_bits": 8 * agg.up_bytes / max(1, agg.rounds)}
        return out

    # -- everything together -------------------------------------------------------------------
    def execute(self) -> None:
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(1)
        rig = Rig(self.logs, link="tbf" if self.shaped_ok else "loopback")
        # The edge and the driver load their models while this process loads its own (nothing is
        # timed yet); they then sit idle through the ceilings.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            starting = pool.submit(rig.__enter__)
            try:
                self.load_models()
            except BaseException:
                with contextlib.suppress(BaseException):
                    starting.result()
                    rig.__exit__(None, None, None)
                raise
            starting.result()  # re-raises a failed start (the rig has cleaned up after itself then)
        try:
            self.measure_ceilings()
            self.run_links(rig)
        finally:
            rig.__exit__(None, None, None)
        self.bar.set_description("done")
        self.bar.close()


# ----------------------------------------------------------------------------- tables
def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        path.write_text("")
        return
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def make_plots(t: dict, d: dict, out: Path) -> list[str]:
    pdir = out / "plots"
    pdir.mkdir(exist_ok=True)
    made = []
    st = d["settings"]
    base = sorted(b["tokens_per_second"] for b in d.get("baselines", {}).values())
    noise = f"target alone {base[0]:.1f}-{base[-1]:.1f} tok/s across the run; " if base else ""
    plots.set_note(noise + f"drafter {d.get('draft_model')} -> target {d.get('edge_model')}; T = {st['temperature']}; "
                   f"<= {st['max_new_tokens']} new tokens/session, {st['rate_prompts']} prompt(s) per rate point, "
                   f"{st['loop_prompts']} per loopback point; {d['machine'].get('cpu_model')} x"
                   f"{d['machine'].get('logical_cores')}, 1 torch thread/process, shared; "
                   f"{d['started']}, git {str((d.get('git') or {}).get('revision'))[:8]}")
    vocab = d.get("vocab_size") or 0
    sqs_link = t["sqs"][0]["link"] if t["sqs"] else ""
    attempts = [
        ("fig3_topk_mass.png", t["topk_mass"],
         lambda p: plots.topk_mass(t["topk_mass"], vocab, d.get("draft_model", ""), p)),
        ("fig4_acceptance_vs_k.png", t["acceptance_vs_k"],
         lambda p: plots.acceptance_vs_k(t["acceptance_vs_k"], vocab, p)),
        ("fig5_6_speedup_vs_rate.png", t["rate_curve"],
         lambda p: plots.speedup_vs_rate(t["rate_curve"], t["ceilings"], p)),
        ("bytes_per_token.png", t["loopback"],
         lambda p: plots.bytes_per_token([r for r in t["loopback"] if r["role"] == "grid"], p)),
        ("sqs_fig2.png", t["sqs"],
         lambda p: plots.sqs_fig2(t["sqs"], sqs_link, st["sqs_bit_budget"], st["sqs_lattice"], p)),
        ("ceilings.png", t["ceilings"], lambda p: plots.ceilings(t["ceilings"], p)),
    ]
    for name, data, fn in attempts:
        if not data:
            continue
        try:
            fn(pdir / name)
            made.append(name)
        except Exception as exc:  # one bad figure must not lose the tables
            print(f"plot {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return made


def write_outputs(d: dict, out: Path) -> dict:
    t = tables.build(d)
    for name in ("rate_curve", "loopback", "acceptance_vs_k", "topk_mass", "sqs"):
        write_csv(out / f"{name}.csv", t[name])
    (out / "ceilings.json").write_text(json.dumps(t["ceilings"], indent=2))
    made = make_plots(t, d, out)
    summary = summarize(t, d)
    summary["plots"] = made
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def block_summary(b: dict, sessions: list[dict]) -> dict:
    """A link phase with its serialized bytes next to what the kernel's qdisc sent (TCP/IP + HTTP/2)."""
    out = dict(b)
    mine = [x["record"]["stats"] for x in sessions if x["link"] == b["link"]]
    serialized = sum(st["uplink_bytes"] + st["setup_bytes"] for st in mine)
    out["uplink_serialized_bytes"] = serialized
    if not b["rate_bps"]:
        out["uplink_wire_bytes"] = None  # no qdisc on an unshaped link: no count
    if not b.get("down_rate_bps"):
        out["downlink_wire_bytes"] = None
    if out["uplink_wire_bytes"] and serialized:
        out["uplink_wire_over_serialized"] = out["uplink_wire_bytes"] / serialized
    return out


def summarize(t: dict, d: dict) -> dict:
    s = d["settings"]
    key = {}
    for r in t["rate_curve"]:
        key.setdefault(f"{r['config']}/{r['shape']}", {})[r["link"]] = {
            "speedup": finite_or_none(r["speedup"]),
            "predicted": finite_or_none(r["predicted_speedup"])}
    base = [b["tokens_per_second"] for jid, b in d["baselines"].items()
            if d["jobs"][jid]["max_new_tokens"] == s["max_new_tokens"]]
    return {
        "machine": d["machine"], "git": d["git"],
        "models": {"target": d.get("edge_model"), "drafter": d.get("draft_model")},
        "settings": s, "started": d["started"], "runtime_s": d["runtime_s"],
        "sampled": {
            "prompts": d["prompts"],
            "rate_curve": f"{s['rate_prompts']} prompt(s) x <= {s['max_new_tokens']} new tokens per point "
                          f"(fewer where 'reduced'), seeds {harness_plan.SEED_BASE}+i, T = {s['temperature']}",
            "loopback": f"{s['loop_prompts']} prompt(s) x <= {s['max_new_tokens']} new tokens per config",
            "ceilings": f"{s['loop_prompts']} prompt(s), same seeds and length, in one process",
            "sqs": f"{s['sqs_prompts']} prompt(s) per (mode, T), B = {s['sqs_bit_budget']} bits, "
                   f"ell = {s['sqs_lattice']}, draft length <= {s['sqs_max_draft']}",
            "sessions": len(d["sessions"]), "failed_sessions": len(d["errors"]),
        },
        "noise": {"what": "target-alone tokens/s of the same computation (rate-curve prompts, full length) "
                          "repeated after every rate-curve point; its spread is the shared cores' noise",
                  "target_alone_tps_min_median_max": [min(base), tables.target_tps(d), max(base)] if base else None,
                  "loadavg_start": d["machine"].get("loadavg_start"), "loadavg_end": d.get("loadavg_end")},
        "blocks": [block_summary(b, d["sessions"]) for b in d["blocks"]], "errors": d["errors"][:20],
        "key_speedups": key,
        "ceilings": {k: v for k, v in t.get("ceilings", {}).items() if k != "ours"} | {
            "ours_loopback": t.get("ceilings", {}).get("ours")},
        "acceptance_vs_k": t["acceptance_vs_k"],
    }


def print_report(summary: dict, t_path: Path) -> None:
    print(f"\nresults: {t_path}")
    c = summary.get("ceilings") or {}
    if c:
        ran = not c.get("assisted_error")
        print(f"target alone {c.get('target_tps', float('nan')):.2f} tok/s, HF assisted "
              + (f"{c.get('assisted_tps', float('nan')):.2f} tok/s" if ran else f"not run: {c['assisted_error']}"))
        for name, v in (c.get("ours_loopback") or {}).items():
            vs_assisted = (f"{(v['ratio_to_assisted'] or float('nan')):.2f}x assisted "
                           f"({(v['ratio_to_assisted_normalized'] or float('nan')):.2f}x as speedups, "
                           f"{(v['ratio_to_assisted_cpu'] or float('nan')):.2f}x in CPU time), ") if ran else ""
            print(f"  ours {name:10s} loopback {v['tokens_per_s']:.2f} tok/s = {vs_assisted}"
                  f"{(v['speedup_vs_target'] or float('nan')):.2f}x the target alone "
                  f"({(v['speedup_cpu_vs_target'] or float('nan')):.2f}x in CPU time), "
                  f"acceptance {v['acceptance']:.3f}")
    print("speedup over the target alone, measured / oracle model, per link:")
    for k, v in summary["key_speedups"].items():
        cells = "  ".join(f"{link}: {x['speedup'] or float('nan'):.2f}/{x['predicted'] or float('nan'):.2f}"
                          for link, x in v.items())
        print(f"  {k:18s} {cells}")
    print(f"sampled: {summary['sampled']['rate_curve']}; noise: target alone min/median/max "
          f"{[round(p, 2) for p in summary['noise']['target_alone_tps_min_median_max'] or []]} tok/s")


def publish(plots_dir: Path, dest: Path) -> None:
    """Copy a run's plots as 256-colour PNGs (about a third of the size) for committing."""
    from PIL import Image

    dest.mkdir(parents=True, exist_ok=True)
    for png in sorted(plots_dir.glob("*.png")):
        Image.open(png).convert("RGB").quantize(colors=256).save(dest / png.name, optimize=True)
        print(f"published {dest / png.name}")


# ----------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="< 3 min: one shaped link, one prompt, short sessions")
    p.add_argument("--out", type=Path, default=RESULTS, help="parent of the timestamped results folder")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--rate-prompts", type=int, help="prompts per rate-curve point")
    p.add_argument("--loop-prompts", type=int, help="prompts per loopback point and per ceiling")
    p.add_argument("--rates", help="shaped uplink rates in Mbit/s, comma-separated (e.g. 1,10,100)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--no-shaping", action="store_true", help="loopback only (no namespaces / tc)")
    p.add_argument("--replot", type=Path, help="rebuild tables and plots from a results folder's raw.json")
    p.add_argument("--publish", type=Path, help="with --replot: copy the plots there as small palette PNGs "
                                                "(docs/bench)")
    return p.parse_args(argv)


def settings_from(args) -> plan.Settings:
    s = plan.Settings.preset(args.quick)
    over = {}
    if args.max_new_tokens:
        over["max_new_tokens"] = args.max_new_tokens
    if args.rate_prompts:
        over["rate_prompts"] = args.rate_prompts
    if args.loop_prompts:
        over["loop_prompts"] = args.loop_prompts
    if args.rates:
        over["rates_mbit"] = tuple(sorted((float(x) for x in args.rates.split(",") if x), reverse=True))
    if args.temperature is not None:
        over["temperature"] = args.temperature
    s = replace(s, **over)
    if s.loop_prompts < s.rate_prompts:
        s = replace(s, loop_prompts=s.rate_prompts)
    return s


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        d = json.loads((args.replot / "raw.json").read_text())
        summary = write_outputs(d, args.replot)
        print_report(summary, args.replot)
        if args.publish:
            publish(args.replot / "plots", args.publish)
        return 0
    s = settings_from(args)
    reason = "--no-shaping" if args.no_shaping else shaping_available()
    out = harness_plan.run_dir(args.out, harness_plan.stamp(s.quick))
    started = dt.datetime.now().isoformat(timespec="seconds")
    run = Run(s, out, shaped_ok=reason is None, no_shaping_reason=reason)
    if reason:
        tqdm.write(f"shaped links skipped: {reason}")
    try:
        run.execute()
    except KeyboardInterrupt:
        run.bar.close()
        print("interrupted: writing what was measured", file=sys.stderr)
    d = {"settings": s.to_json(), "machine": run.machine, "git": harness_plan.git_info(), "started": started,
         "runtime_s": time.perf_counter() - run.t0, "loadavg_end": list(os.getloadavg()), "prompts": run.prompts,
         "jobs": {j.id: {"id": j.id, "link": j.link, "config": j.config.name, "shape": j.config.shape,
                         "family": j.config.family, "K": j.config.k, "role": j.role, "reduced": j.reduced,
                         "max_new_tokens": j.max_new_tokens, "prompts": j.prompts, "device": j.config.device}
                  for j in run.jobs.values()},
         "sessions": run.sessions, "errors": run.errors, "blocks": run.blocks, "baselines": run.baselines,
         "point_cpu": run.point_cpu,
         "ceilings": run.ceil, "draft_model": run.draft_model,
         "edge_model": next((x["record"].get("edge_model") for x in run.sessions), None),
         "vocab_size": getattr(getattr(run, "target", None), "vocab_size", None),
         "shaping": "namespaces + tbf" if reason is None else f"skipped: {reason}"}
    (out / "raw.json").write_text(json.dumps(d))
    with (out / "sessions.jsonl").open("w") as f:
        for x in run.sessions:
            f.write(json.dumps(x) + "\n")
    summary = write_outputs(d, out)
    print_report(summary, out)
    print(f"runtime {d['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
