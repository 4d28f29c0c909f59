"""Expansion-configured token trees: indexing, tree attention, and lossless tree verification.

Convention: ``p`` is the target distribution, ``q`` the draft distribution (see verification.py).

References: TSLT (Zheng et al., "Fast Collaborative Inference via Distributed Speculative Decoding")
§4.1, Def. 4.2 (expansion configuration ``K = <k_1, ..., k_L>``) and eq. (23)-(24) (layer-order
node indexing with consecutive children); §4.2, eq. (27) (number of draft distributions = number
of internal nodes), Alg. 7 (TokTreeDraft: the children of each node are ``k`` candidates sampled
from that node's ``q``, with replacement) and Alg. 8 (TokenTreeVeri: multi-candidate verification
per node, Alg. 5, then a path search from the root). SpecInfer (Miao et al. 2024) for the tree
attention mask.

Node indexing (eq. 23-24): node 0 is the root ``x_{0,1}`` (the prefix); then layer 1 nodes
``x_{1,1..W_1}``, then layer 2, and so on, so node ``x_{l,i}`` (1-based ``i``) has index
``offset_l + i - 1`` with ``offset_l = W_0 + ... + W_{l-1}`` and ``W_l = k_1 * ... * k_l``. The
children of ``x_{l,i}`` are ``x_{l+1, (i-1)k_{l+1}+1 .. i k_{l+1}}``: consecutive indices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.common.validation import check_drafts_sampleable, check_generator, check_prob_rows, check_token_ids
# mc_verify_unchecked: tree_verify validates the whole tree once, not once per node
from specdec.common.verification import mc_verify_unchecked, sample_token

ROOT = 0  # node index of the root x_{0,1}, i.e. the prefix
NO_PARENT = -1  # parents[ROOT]


@dataclass(frozen=True, eq=False)
class TreeSpec:
    """Shape of an expansion-configured token tree (TSLT Def. 4.2); build with ``from_config``."""

    config: tuple[int, ...]  # <k_1, ..., k_L>: every node at layer l-1 has k_l children
    layer_widths: tuple[int, ...]  # [L+1] W_l = prod_{j<=l} k_j, W_0 = 1
    layer_offsets: tuple[int, ...]  # [L+2] index of the first node of layer l; last entry = num_nodes
    parents: torch.Tensor = field(repr=False)  # [N] int64, parent node index, -1 for the root
    depths: torch.Tensor = field(repr=False)  # [N] int64, layer of each node (root 0)

    @classmethod
    def from_config(cls, config: Sequence[int]) -> "TreeSpec":
        """Build the tree for ``<k_1..k_L>`` (L >= 1, every k_l >= 1); ValueError otherwise."""
        ks = tuple(config)
        if len(ks) == 0:
            raise ValueError("expansion configuration must have at least one layer")
        if any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
            raise ValueError(f"every k_l must be an int >= 1, got {list(config)!r}")
        widths = [1]
        for k in ks:
            widths.append(widths[-1] * k)  # n_l = n_{l-1} * k_l
        offsets = [0]
        for w in widths:
            offsets.append(offsets[-1] + w)
        parents = [NO_PARENT]
        depths = [0]
        for layer, k in enumerate(ks, start=1):
            for j in range(widths[layer]):  # 0-based j of x_{layer, j+1}; eq. 23 inverted
                parents.append(offsets[layer - 1] + j // k)
                depths.append(layer)
        return cls(
            config=ks,
            layer_widths=tuple(widths),
            layer_offsets=tuple(offsets),
            parents=torch.tensor(parents, dtype=torch.int64),
            depths=torch.tensor(depths, dtype=torch.int64),
        )

    @property
    def depth(self) -> int:
        """L, the number of drafted layers."""
        return len(self.config)

    @property
    def num_nodes(self) -> int:
        """N = sum_l W_l, root included."""
        return self.layer_offsets[-1]

    @property
    def internal_nodes(self) -> range:
        """Nodes with children (layers 0..L-1); their count is eq. (27)."""
        return range(0, self.layer_offsets[self.depth])

    @property
    def num_internal(self) -> int:
        """|Q| of eq. (27): 1 + sum_{i=1}^{L-1} prod_{j<=i} k_j, one draft distribution each."""
        return len(self.internal_nodes)

    @property
    def leaves(self) -> range:
        """Nodes of layer L."""
        return range(self.layer_offsets[self.depth], self.num_nodes)

    def node(self, layer: int, i: int) -> int:
        """Index of ``x_{layer, i}`` (1-based ``i``, as in the paper)."""
        if not 0 <= layer <= self.depth or not 1 <= i <= self.layer_widths[layer]:
            raise ValueError(f"no node x_{{{layer},{i}}} in a tree with widths {self.layer_widths}")
        return self.layer_offsets[layer] + i - 1

    def paths(self, node_tokens: Sequence[int]) -> list[list[int]]:
        """Each node's tokens from the root down to it, the root's own entry left out (``[]`` for the
        root): what follows the verified prefix at the position after that node. ``node_tokens``:
        [num_nodes] (nodes built in layer order, so a parent's path exists before its children's)."""
        if len(node_tokens) != self.num_nodes:
            raise ValueError(f"{len(node_tokens)} node tokens for {self.num_nodes} nodes")
        paths: list[list[int]] = [[]]
        for n, parent in enumerate(self.parents.tolist()[1:], start=1):
            paths.append(paths[parent] + [int(node_tokens[n])])
        return paths

    def children(self, node: int) -> range:
        """C(x_{l,i}) of eq. (23) as node indices (empty for a leaf)."""
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} out of range [0, {self.num_nodes})")
        layer = int(self.depths[node])
        if layer == self.depth:
            return range(0)
        k = self.config[layer]
        first = self.layer_offsets[layer + 1] + (node - self.layer_offsets[layer]) * k
        return range(first, first + k)


def tree_attention_mask(spec: TreeSpec) -> torch.Tensor:
    """Tree attention over the non-root nodes (SpecInfer-style), [N-1, N-1] bool.

    Entry (i, j) refers to nodes i+1 and j+1 and is True iff node j+1 is node i+1 itself or one of
    its ancestors: each drafted token attends only to its own path. The prefix (root) is visible to
    every node; the caller prepends it.
    """
    n = spec.num_nodes - 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    rows = torch.arange(n)
    cur = torch.arange(1, spec.num_nodes)  # [N-1], walks up from each node to the root
    for _ in range(spec.depth):
        live = cur > ROOT
        mask[rows[live], cur[live] - 1] = True
        cur = torch.where(live, spec.parents[cur.clamp(min=0)], cur)
    return mask


def tree_position_offsets(spec: TreeSpec) -> torch.Tensor:
    """[N-1] int64 position offsets of the non-root nodes: depth - 1, so a node's position id is
    ``prefix_len + depth - 1`` (siblings share a position, as in a plain chain of that length)."""
    return spec.depths[1:] - 1


@dataclass(frozen=True)
class TreeResult:
    """Outcome of tree verification."""

    accepted_nodes: list[int]  # node indices of the accepted path, root excluded, in depth order
    tokens: list[int]  # tokens of accepted_nodes + the final correction / bonus token


def tree_verify(
    spec: TreeSpec,
    node_tokens: torch.Tensor,  # [N] int64, node_tokens[0] (root) ignored
    q: torch.Tensor,  # [num_internal, V] float64, draft distribution at each internal node
    p: torch.Tensor,  # [N, V] float64, target distribution after each node (row 0: after the prefix)
    generator: torch.Generator,
    *,
    with_replacement: bool = True,
) -> TreeResult:
    """Lossless token-tree verification (TSLT Alg. 8 with Alg. 5 per node).

    Starting at the root: run ``mc_verify`` (verification.py) on the node's children with the
    node's ``q`` and ``p``; if a child is accepted append its token and descend into it (the
    accepted candidate's index picks the child, which matters when siblings drawn with replacement
    share a token); otherwise emit the output token (a sample of the recursive residual, which has
    no mass on the rejected children) and stop. On reaching a leaf emit a bonus token from
    ``p[leaf]``.

    Only the nodes on the returned path are verified: Alg. 8 verifies every node in parallel, but
    the path search reads only the verdicts of path nodes, and each verdict depends only on its own
    node's children, q, p and fresh uniforms, so verifying lazily along the path yields the same
    output distribution at a fraction of the cost.

    Random draws, in order: for each node on the path, those of ``mc_verify`` (one uniform per
    accept test, plus one for the residual sample if all children are rejected); then one uniform
    for the bonus token if a leaf is reached. For ``<1, ..., 1>`` this is exactly the draw sequence
    of ``chain_verify``, so both give identical results for the same generator state.
    """
    _check_tree_inputs(spec, node_tokens, q, p, generator, with_replacement)
    tokens_list = node_tokens.tolist()
    accepted: list[int] = []
    tokens: list[int] = []
    node = ROOT
    while True:
        kids = spec.children(node)
        if len(kids) == 0:
            tokens.append(sample_token(p[node], generator))  # bonus token from p after the leaf
            return TreeResult(accepted_nodes=accepted, tokens=tokens)
        candidates = tokens_list[kids.start : kids.stop]
        idx, token = mc_verify_unchecked(candidates, q[node], p[node], generator, with_replacement)
        tokens.append(token)
        if idx < 0:
            return TreeResult(accepted_nodes=accepted, tokens=tokens)
        node = kids[idx]
        accepted.append(node)


def _check_tree_inputs(
    spec: TreeSpec,
    node_tokens: torch.Tensor,  # [N] int64
    q: torch.Tensor,  # [num_internal, V] float64
    p: torch.Tensor,  # [N, V] float64
    generator: torch.Generator,
    with_replacement: bool,
) -> None:
    """Validate a whole tree once, so the per-node verification can skip its own checks."""
    check_generator(generator)
    check_prob_rows(q, "q", rows=spec.num_internal)
    V = q.shape[1]
    check_prob_rows(p, "p", rows=spec.num_nodes, vocab=V)
    if not isinstance(node_tokens, torch.Tensor) or node_tokens.shape != (spec.num_nodes,):
        raise ValueError(f"node_tokens must be a tensor [{spec.num_nodes}] (root included)")
    drafted = node_tokens[1:]  # [N-1], the root entry is ignored
    check_token_ids(drafted, "node_tokens[1:]", V)
    q_of_drafted = q[spec.parents[1:], drafted]  # [N-1] q of each child under its parent's q
    check_drafts_sampleable(drafted, q_of_drafted, "node_tokens", first_index=1)
    if not with_replacement:
        for parent in spec.internal_nodes:
            kids = spec.children(parent)
            if torch.unique(node_tokens[kids.start : kids.stop]).numel() != len(kids):
                raise ValueError(f"children of node {parent} must be distinct without replacement")


def num_internal_nodes(config: Sequence[int]) -> int:
    """Eq. (27) in closed form: 1 + sum_{i=1}^{L-1} prod_{j=1}^{i} k_j."""
    ks = list(config)
    return 1 + sum(math.prod(ks[:i]) for i in range(1, len(ks)))
