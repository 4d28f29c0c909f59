"""specdec's benchmarks (``make bench``, ``bench-links``, ``bench-capacity``, ...): the shared harness
(:mod:`specdec.bench.harness`: the rig, the device driver, prompts and seeds, reporting and plots), the
benchmarks built on it (``papers``, ``links``, ``capacity``) and their entry points (``bench_*.py``,
``run_bench.py``, ``soak.py``). docs/benchmarks.md says what each measures."""
