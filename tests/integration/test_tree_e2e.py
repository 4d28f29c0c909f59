"""Token trees (MC-DSD, TSLT §4) end to end over real gRPC, and the tree attention they rely on."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.support.harness import device_config, edge, load, run, run_sessions, split_sessions, target_greedy
from specdec.common.settings import Mode
from specdec.common.modeling import CachedLM, encode_prompt
from specdec.common.tree import TreeSpec
from specdec.common.treeplan import edge_tree_inputs, path_cache_indices
from tests.integration.test_lossless_e2e import CONCURRENCY, N_TOKENS, PROMPT, TEMPERATURE, exact_law
from tests.support.toy_models import P_VALUE_CUT, goodness_of_fit

PROMPTS = ["w1 w2 w3", "w300 w301 w302 w303 w9"]
MAX_NEW = 12
TREE_SESSIONS = 1200  # statistical tree runs: ~30 s each here


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


@pytest.mark.parametrize("kw", [dict(mode=Mode.DENSE, dense_dtype="fp32"), dict(mode=Mode.TSLT, top_k=3),
                                dict(mode=Mode.KSQS, top_k=3, lattice=8)], ids=lambda kw: kw["mode"].value)
def test_branching_tree_is_lossless(twin, tiny_pair_v8, kw) -> None:
    target_dir, drafter_dir = tiny_pair_v8
    cfg_kw = dict(temperature=TEMPERATURE, max_new_tokens=N_TOKENS, tree=(2, 2), **kw)
    tok = load(str(drafter_dir)).tokenizer
    law = exact_law(str(target_dir), tuple(encode_prompt(tok, PROMPT, raw=True)))
    # half of the sessions in the twin process (harness.Twin): same seeds, same tokens, both cores
    results = split_sessions(twin, range(TREE_SESSIONS), target_dir, drafter_dir, cfg_kw, PROMPT,
                             concurrency=CONCURRENCY)
    counts = Counter(tuple(tokens) for tokens, _, _ in results)
    fit = goodness_of_fit(counts, law)
    assert fit.p_value > P_VALUE_CUT, str(fit)


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
