"""``make bench`` (bench/run_bench.py), the papers' figures on the harness's rig: plan (what runs),
ceilings (target alone, HF assisted generation), analyze + tables (numbers), plots (figures)."""
