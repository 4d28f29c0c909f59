"""Token-tree indexing (TSLT eq. 23-24, 27), tree attention, positions, and tree verification.

The statistical losslessness of tree_verify is tested in test_lossless.py.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from specdec.common.tree import (
    TreeSpec,
    num_internal_nodes,
    tree_attention_mask,
    tree_position_offsets,
    tree_verify,
)
from specdec.common.verification import chain_verify

CONFIGS = [(1,), (3,), (2, 2), (2, 2, 2), (3, 1, 1), (1, 1, 1, 1), (1, 3, 2), (4, 2)]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- indexing --------------------------------------------------------------------------------


def expected_layout(config: tuple[int, ...]) -> dict[tuple[int, int], int]:
    """(layer, 1-based i) -> node index, enumerated in the order of eq. (24)."""
    layout, idx, width = {(0, 1): 0}, 1, 1
    for k in config:
        width *= k
        layer = len({l for l, _ in layout})
        for i in range(1, width + 1):
            layout[(layer, i)] = idx
            idx += 1
    return layout


@pytest.mark.parametrize("config", [(2, 2, 2), (3, 1, 1)])
def test_children_follow_eq_23(config: tuple[int, ...]) -> None:
    spec = TreeSpec.from_config(config)
    layout = expected_layout(config)
    assert spec.num_nodes == len(layout)
    for (l, i), node in layout.items():
        assert spec.node(l, i) == node
        assert int(spec.depths[node]) == l
        if l < len(config):
            k = config[l]
            want = [layout[(l + 1, j)] for j in range((i - 1) * k + 1, i * k + 1)]  # eq. (23)
            assert list(spec.children(node)) == want
            for c in want:
                assert int(spec.parents[c]) == node
        else:
            assert len(spec.children(node)) == 0
    assert int(spec.parents[0]) == -1


def test_explicit_222_layout() -> None:
    spec = TreeSpec.from_config([2, 2, 2])
    assert spec.layer_widths == (1, 2, 4, 8)
    assert spec.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert spec.depths.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    assert list(spec.children(2)) == [5, 6]
    assert list(spec.internal_nodes) == list(range(7))
    assert list(spec.leaves) == list(range(7, 15))


def test_explicit_311_layout() -> None:
    spec = TreeSpec.from_config([3, 1, 1])
    assert spec.parents.tolist() == [-1, 0, 0, 0, 1, 2, 3, 4, 5, 6]
    assert spec.depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert spec.num_internal == 7


@pytest.mark.parametrize("config", CONFIGS)
def test_internal_count_is_eq_27(config: tuple[int, ...]) -> None:
    spec = TreeSpec.from_config(config)
    assert spec.num_internal == num_internal_nodes(config)
    assert spec.num_internal + len(spec.leaves) == spec.num_nodes
    assert all(len(spec.children(n)) == config[int(spec.depths[n])] for n in spec.internal_nodes)


def test_eq_27_values() -> None:
    assert num_internal_nodes([2, 2, 2]) == 1 + 2 + 4
    assert num_internal_nodes([3, 1, 1]) == 1 + 3 + 3
    assert num_internal_nodes([5]) == 1


@pytest.mark.parametrize("bad", [[], [0], [2, 0], [1, -1], [1.5], [True]])
def test_from_config_rejects_bad_config(bad) -> None:
    with pytest.raises(ValueError):
        TreeSpec.from_config(bad)


# --- attention mask and positions -------------------------------------------------------------


def ancestors(spec: TreeSpec, node: int) -> set[int]:
    out = set()
    while node > 0:
        node = int(spec.parents[node])
        out.add(node)
    return out


@pytest.mark.parametrize("config", CONFIGS)
def test_mask_is_exactly_ancestor_or_self(config: tuple[int, ...]) -> None:
    spec = TreeSpec.from_config(config)
    mask = tree_attention_mask(spec)
    n = spec.num_nodes - 1
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    for a, b in itertools.product(range(1, spec.num_nodes), repeat=2):
        visible = b == a or b in ancestors(spec, a)
        assert bool(mask[a - 1, b - 1]) == visible, (a, b)
    # each row sees exactly its depth many nodes (itself + non-root ancestors)
    assert mask.sum(dim=1).tolist() == spec.depths[1:].tolist()


@pytest.mark.parametrize("config", CONFIGS)
def test_positions_are_depths(config: tuple[int, ...]) -> None:
    spec = TreeSpec.from_config(config)
    pos = tree_position_offsets(spec)
    assert pos.dtype == torch.int64
    assert pos.tolist() == [int(spec.depths[n]) - 1 for n in range(1, spec.num_nodes)]


# --- tree_verify --------------------------------------------------------------------------------


def random_dists(rows: int, vocab: int, seed: int, sharp: float = 2.0) -> torch.Tensor:
    logits = sharp * torch.randn(rows, vocab, generator=gen(seed), dtype=torch.float64)
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("L", [1, 2, 4])
@pytest.mark.parametrize("seed", range(40))
def test_chain_config_reproduces_chain_verify(L: int, seed: int) -> None:
    V = 6
    spec = TreeSpec.from_config([1] * L)
    q = random_dists(L, V, seed)
    p = random_dists(L + 1, V, seed + 1000)
    draft = torch.stack([torch.multinomial(q[i], 1, generator=gen(seed + i)) for i in range(L)]).squeeze(1)
    node_tokens = torch.cat([torch.tensor([0]), draft])
    chain = chain_verify(draft, q, p, gen(seed))
    tree = tree_verify(spec, node_tokens, q, p, gen(seed))
    assert tree.accepted_nodes == list(range(1, chain.num_accepted + 1))
    assert tree.tokens == draft[: chain.num_accepted].tolist() + [chain.next_token]


def test_tree_follows_accepted_child_and_emits_bonus_at_leaf() -> None:
    V = 4
    spec = TreeSpec.from_config([2, 2])
    # root children tokens 1, 2; p after the prefix is one-hot at 2: the second child is accepted
    node_tokens = torch.tensor([0, 1, 2, 0, 3, 3, 0], dtype=torch.int64)
    q = torch.full((spec.num_internal, V), 0.25, dtype=torch.float64)
    p = torch.full((spec.num_nodes, V), 0.25, dtype=torch.float64)
    p[0] = torch.tensor([0, 0, 1, 0], dtype=torch.float64)
    # after token 2: node 5 (token 3) is rejected, node 6 (token 0) accepted
    p[2] = torch.tensor([1, 0, 0, 0], dtype=torch.float64)
    p[6] = torch.tensor([0, 0, 0, 1], dtype=torch.float64)  # bonus after the leaf is 3
    for seed in range(20):
        res = tree_verify(spec, node_tokens, q, p, gen(seed))
        assert res.accepted_nodes == [2, 6]
        assert res.tokens == [2, 0, 3]


def test_tree_stops_with_correction_when_all_children_rejected() -> None:
    V = 4
    spec = TreeSpec.from_config([2, 1])
    node_tokens = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int64)
    q = torch.full((spec.num_internal, V), 0.25, dtype=torch.float64)
    p = torch.full((spec.num_nodes, V), 0.25, dtype=torch.float64)
    p[0] = torch.tensor([1, 0, 0, 0], dtype=torch.float64)
    for seed in range(20):
        assert tree_verify(spec, node_tokens, q, p, gen(seed)).tokens == [0]


def test_tree_verify_rejects_bad_input() -> None:
    V = 4
    spec = TreeSpec.from_config([2])
    q = torch.full((1, V), 0.25, dtype=torch.float64)
    p = torch.full((3, V), 0.25, dtype=torch.float64)
    ok = torch.tensor([0, 1, 2], dtype=torch.int64)
    tree_verify(spec, ok, q, p, gen())
    with pytest.raises(ValueError, match="rows"):
        tree_verify(spec, ok, q, p[:2], gen())
    with pytest.raises(ValueError, match="node_tokens"):
        tree_verify(spec, ok[:2], q, p, gen())
    with pytest.raises(ValueError, match="out of range"):
        tree_verify(spec, torch.tensor([0, 1, V], dtype=torch.int64), q, p, gen())
    q0 = torch.tensor([[0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="probability 0"):
        tree_verify(spec, ok, q0, p, gen())
    with pytest.raises(ValueError, match="distinct"):
        tree_verify(spec, torch.tensor([0, 1, 1], dtype=torch.int64), q, p, gen(), with_replacement=False)
