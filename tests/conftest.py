"""Shared fixtures: tiny real checkpoints on disk, loaded through the product's loading code."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specdec.testbed import tiny_models

# Tiny models are dominated by thread hand-off: one intra-op thread is ~20x faster on 2 cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The modules that cost the most (their tests' seconds summed, most first: `make test` prints the
# slowest tests), handed to `make test`'s workers before the rest. xdist's own order for --dist
# loadscope (the most tests first) left these few-test modules to the end, one worker finishing them
# while the other idled; `make test` turns that order off (--no-loadscope-reorder) and keeps this one.
HEAVY_FIRST = (
    "tests/integration/test_draft_ahead.py", "tests/unit/test_lossless.py", "tests/integration/test_grammar_law.py",
    "tests/integration/test_decisions_see_only_the_past.py", "tests/integration/test_target_law.py",
    "tests/integration/test_lossless_in_process.py", "tests/integration/test_lossless_e2e.py",
    "tests/integration/test_gumbel.py", "tests/integration/test_auto.py", "tests/unit/test_default_drafter.py",
    "tests/integration/test_batching_e2e.py", "tests/tools/test_testbed.py", "tests/integration/test_fleet_proxy.py",
    "tests/integration/test_metrics_prometheus.py", "tests/integration/test_run_ahead.py",
    "tests/integration/test_tree_e2e.py", "tests/integration/test_cli.py", "tests/integration/test_fuzz.py",
    "tests/integration/test_packaging.py", "tests/unit/test_verification.py", "tests/integration/test_fleet.py",
    "tests/tools/test_gpu_check.py", "tests/integration/test_resume_lossless.py", "tests/integration/test_late_round.py",
    "tests/integration/test_demo.py", "tests/integration/test_embedded_default.py", "tests/integration/test_resume.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """HEAVY_FIRST's modules first, in its order; every other test after them, as collected."""
    rank = {module: i for i, module in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def tiny_pair_v8(tmp_path_factory) -> tuple[Path, Path]:
    """Target and a close drafter with an 8-token vocabulary (statistical tests)."""
    root = tmp_path_factory.mktemp("tiny8")
    target = tiny_models.make_model(root / "target-v8", 8, seed=1)
    return target, tiny_models.make_close_drafter(target, root / "draft-v8", noise=0.3)


@pytest.fixture(scope="session")
def byte_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Target and a close drafter over a byte-level vocabulary (258 tokens): grammars (JSON, regexes)
    can be matched against it, and any text is a sequence of its tokens."""
    root = tmp_path_factory.mktemp("bytes")
    target = tiny_models.make_model(root / "target-bytes", tiny_models.BYTE_VOCAB, seed=1, byte_level=True,
                                    logit_scale=2.0, max_positions=2048)  # a byte per token: long prompts
    return target, tiny_models.make_close_drafter(target, root / "draft-bytes", noise=0.1)


@pytest.fixture(scope="session")
def tiny_pair_v512(tmp_path_factory) -> tuple[Path, Path]:
    """Target and drafter with a 512-token vocabulary (greedy identity, byte accounting)."""
    return tiny_models.make_pair(tmp_path_factory.mktemp("tiny512"), 512, logit_scale=2.0)


@pytest.fixture(scope="session")
def edge_v512(tiny_pair_v512):
    """`edge-server` on tiny_pair_v512's target, started as a user starts it on a shared host: no thread
    flag, no OMP_NUM_THREADS (test_thread_defaults reads its thread line). One process for the tests
    that only need an edge process to talk to: each start costs seconds of imports and loading. It
    must stop gracefully (SIGTERM, exit status 0) at the end of the session."""
    from tests.support.harness import EdgeProcess
    proc = EdgeProcess("--model", str(tiny_pair_v512[0]), env={"OMP_NUM_THREADS": None}, drain=True)
    yield proc
    assert proc.stop() == 0


# Perturbing the target's weights by this x their std leaves ~2/3 of its greedy tokens (argmax) as
# they were: greedy rounds over gRPC both accept drafts (and roll the KV back past the rest) and reject.
GREEDY_DRAFT_NOISE = 0.05


@pytest.fixture(scope="session")
def accepting_pair_v512(tiny_pair_v512, tmp_path_factory) -> tuple[Path, Path]:
    """tiny_pair_v512's target and a drafter made from it that agrees with its greedy choice ~2/3 of
    the time (greedy tests that must see drafts accepted as well as rejected)."""
    target = tiny_pair_v512[0]
    root = tmp_path_factory.mktemp("accepting512")
    return target, tiny_models.make_close_drafter(target, root / "draft-v512", noise=GREEDY_DRAFT_NOISE)


# The default drafter's construction on the tiny target: int4 decoder layers (bfloat16 activations)
# with a head that leaves out "<unk>" and "w5" (ids 0 and 7), which the target does emit: q = 0
# there, so those tokens only ever come from the edge's residual.
INT4_HEAD_IDS = (1, 2, 3, 4, 5, 6)


@pytest.fixture(scope="session")
def int4_reduced_head_drafter(tiny_pair_v8, tmp_path_factory):
    """The int4 reduced-head drafter of tiny_pair_v8's target, as a ModelSpec (each process of a test
    loads it from there)."""
    from specdec.common.modeling import ModelSpec
    from specdec.device import lean_drafter
    from tests.support.harness import load_spec

    delta = tmp_path_factory.mktemp("int4_drafter")
    lean_drafter.save_drafter(delta, torch.tensor(INT4_HEAD_IDS), {"name": "tiny-int4", "num_layers": 2, "int4": True})
    spec = ModelSpec(model=str(tiny_pair_v8[0]), delta=str(delta), builder=lean_drafter.DELTA_BUILDER)
    assert isinstance(load_spec(spec).model.layers[0].qkv, lean_drafter.Int4Linear)  # int4 really runs
    return spec


@pytest.fixture(scope="session")
def bearer_tokens(tmp_path_factory) -> Path:
    """Bearer-token files: the edge's accepted tokens (alice's and bob's, after a comment line), each
    device's own, and one the edge does not know."""
    d = tmp_path_factory.mktemp("tokens")
    (d / "edge.tokens").write_text("# accepted device tokens\ns3cret-alice\ns3cret-bob\n")
    (d / "alice.token").write_text("s3cret-alice\n")
    (d / "bob.token").write_text("s3cret-bob\n")
    (d / "wrong.token").write_text("guess\n")
    return d


@pytest.fixture(scope="session")
def twin(tmp_path_factory):
    """A helper process that runs half of a statistical test's seeded sessions while this process
    runs the other half (harness.Twin): the suite's long statistical runs use both cores. The merged
    results are the same as one process's. SPECDEC_TEST_TWIN=0 runs everything in this process."""
    if os.environ.get("SPECDEC_TEST_TWIN", "1") == "0":
        yield None
        return
    from tests.support.harness import Twin
    helper = Twin(tmp_path_factory.mktemp("twin"))
    yield helper
    helper.close()


@pytest.fixture(scope="session", autouse=True)
def _start_twin_early(request):
    """Start the twin process at the session's first test when any collected test uses it, so that its
    imports are done by the time the first statistical test needs it."""
    if any("twin" in getattr(item, "fixturenames", ()) for item in request.session.items):
        try:
            request.getfixturevalue("twin")
        except Exception:  # noqa: BLE001 - reported by the tests that use it, not by every test
            pass
