"""Token trees (MC-DSD, TSLT §4) end to end over real gRPC, and the tree attention they rely on.

The tree transport path's exact law runs here over gRPC (TSLT trees; dense and K-SQS trees in
process, test_lossless_in_process.py; all three here in the slow tier), with a negative control."""
from __future__ import annotations


import pytest
import torch

from tests.support.harness import device_config, edge, load, run, run_sessions, target_greedy
from specdec.common import verification
from specdec.common.modes import Mode
from specdec.common.modeling import CachedLM, encode_prompt
from specdec.common.tree import TreeSpec
from specdec.common.treeplan import edge_tree_inputs, path_cache_indices
from tests.support.laws import (GROSS_CONTROL_SESSIONS, LAW_SESSIONS, TREE_LAW, TREE_MODES, assert_lossless,
                                assert_rejected, law_counts)

PROMPTS = ["w1 w2 w3", "w300 w301 w302 w303 w9"]
MAX_NEW = 12
TREE_SESSIONS = 1200  # the slow tier's statistical tree runs: ~30 s each here


@pytest.mark.parametrize("tree", [(2, 2, 2), (3, 1, 1), (1, 1, 1, 1)], ids=str)
@pytest.mark.parametrize("mode", [Mode.TSLT, Mode.DENSE], ids=lambda m: m.value)
def test_tree_greedy_equals_target_alone(accepting_pair_v512, tree, mode) -> None:
    target_dir, drafter_dir = accepting_pair_v512
    cfg = device_config(mode=mode, temperature=0.0, max_new_tokens=MAX_NEW, tree=tree, top_k=16)

    async def main():
        async with edge(target_dir) as address:
            return [await run_sessions(address, drafter_dir, cfg, prompt, [0]) for prompt in PROMPTS]

    tok = load(str(drafter_dir)).tokenizer
    results = run(main())
    for prompt, [(tokens, _, session)] in zip(PROMPTS, results):
        assert tokens == target_greedy(target_dir, encode_prompt(tok, prompt, raw=True), MAX_NEW)
        nodes_per_round = TreeSpec.from_config(tree).num_nodes - 1
        assert session.stats.draft_tokens <= session.stats.rounds * nodes_per_round
    assert sum(session.stats.accepted_tokens for [(_, _, session)] in results) > 0  # paths were accepted


def test_chain_shaped_tree_is_the_chain_draw_for_draw(tiny_pair_v512) -> None:
    """<1,1,1,1> at temperature 1 reproduces the chain with L = 4 token for token (same seed)."""
    target_dir, drafter_dir = tiny_pair_v512
    common = dict(mode=Mode.TSLT, top_k=16, temperature=1.0, max_new_tokens=20)

    async def main():
        async with edge(target_dir) as address:
            tree = await run_sessions(address, drafter_dir, device_config(tree=(1, 1, 1, 1), **common), PROMPTS[0], [5, 6])
            chain = await run_sessions(address, drafter_dir, device_config(draft_len=4, **common), PROMPTS[0], [5, 6])
            return tree, chain

    tree, chain = run(main())
    assert [t for t, _, _ in tree] == [t for t, _, _ in chain]


def test_branching_tree_is_lossless_over_grpc(twin, tiny_pair_v8) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=LAW_SESSIONS, over_grpc=True, **TREE_LAW,
                                **TREE_MODES["tslt"])
    assert_lossless(counts, law, "tree <2,2>, tslt")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TREE_MODES))
def test_branching_tree_is_lossless_high_power(twin, tiny_pair_v8, name) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=TREE_SESSIONS, over_grpc=True, **TREE_LAW,
                                **TREE_MODES[name])
    assert_lossless(counts, law, f"tree <2,2>, {name}")


_IID_CANDIDATES = verification.sample_candidates


def candidates_without_replacement(q, k, generator, with_replacement=True):
    """BROKEN (the classic multi-candidate slip): siblings drawn without replacement while the edge
    verifies them as i.i.d. draws (recursive rejection sampling is exact for i.i.d. candidates only)."""
    return _IID_CANDIDATES(q, k, generator, with_replacement=False)


def test_control_tree_siblings_drawn_without_replacement_are_detected(twin, tiny_pair_v8) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=GROSS_CONTROL_SESSIONS, over_grpc=True,
                                patches=[(verification, "sample_candidates", candidates_without_replacement)],
                                **TREE_LAW, **TREE_MODES["tslt"])
    assert_rejected(counts, law, "tree siblings without replacement")


def _fresh_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("tree", [(2, 2, 2), (3, 1, 2)], ids=str)
def test_tree_forward_sees_only_ancestors_and_kept_path_matches_fresh_forward(tiny_pair_v512, tree) -> None:
    """Each node's logits equal a fresh forward over prefix + its own path (no branch leaks into
    another), and after compaction to one path the cache predicts like a fresh forward."""
    m = load(str(tiny_pair_v512[0]))
    spec = TreeSpec.from_config(tree)
    g = torch.Generator().manual_seed(0)
    node_tokens = torch.randint(2, m.vocab_size, (spec.num_nodes,), generator=g).tolist()
    prefix = [5, 6, 7, 8, 9]
    lm = CachedLM(m.model, m.device)
    lm.forward(prefix[:3], num_logits=1)  # part of the prefix already cached, as mid-generation
    tail = prefix[3:]
    attend, positions = edge_tree_inputs(spec, lm.cache_len, len(tail))
    logits = lm.forward_masked(tail + node_tokens[1:], attend, positions, spec.num_nodes)

    def path(node: int) -> list[int]:
        out = []
        while node > 0:
            out.append(node)
            node = int(spec.parents[node])
        return out[::-1]

    for node in range(spec.num_nodes):
        expected = _fresh_logits(m.model, prefix + [node_tokens[n] for n in path(node)])[-1]
        torch.testing.assert_close(logits[node], expected, atol=1e-4, rtol=1e-4)
    leaf = spec.num_nodes - 1
    lm.keep(path_cache_indices(len(prefix), path(leaf), fed_until=spec.num_nodes))
    accepted = prefix + [node_tokens[n] for n in path(leaf)]
    assert lm.cache_len == len(accepted)
    nxt = lm.forward([3], num_logits=1)[0]
    torch.testing.assert_close(nxt, _fresh_logits(m.model, accepted + [3])[-1], atol=1e-4, rtol=1e-4)
