"""Modules of ``bench/run_bench.py``: plan (what runs), driver (device process), links (edge + driver over
loopback or a shaped link), ceilings (target alone, HF assisted generation), analyze + tables (numbers),
plots (figures)."""
