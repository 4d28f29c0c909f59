"""Attention patterns, position ids and cache bookkeeping for running token trees through a
KV-cached causal LM (Zheng et al., "Fast Collaborative Inference via Distributed Speculative
Decoding", §4.2: Alg. 7 drafting layer by layer, Alg. 8 one target forward).

Pure functions over :class:`~specdec.common.tree.TreeSpec`; no model inside. Conventions: the
verified prefix has ``prefix_len`` tokens; tree node ``n >= 1`` is placed right after the prefix in
node order, at sequence index ``prefix_len + n - 1``; its position id is ``prefix_len + depth - 1``
(siblings share a position, as they would in a chain). A node attends to the whole prefix, to its
ancestors and to itself, never to another branch (the bug class this module exists to avoid).
"""
from __future__ import annotations

import torch

from specdec.common.tree import TreeSpec, tree_attention_mask, tree_position_offsets


def edge_tree_inputs(spec: TreeSpec, cache_len: int, tail_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and positions for the edge's single forward over ``tail + all non-root nodes``.

    The cache holds ``cache_len`` prefix tokens, the ``tail_len >= 1`` remaining prefix tokens are fed
    causally, then the ``N - 1`` nodes with tree attention.
    Returns attend [T + N - 1, cache_len + T + N - 1] bool and positions [T + N - 1] int64.
    """
    if cache_len < 0 or tail_len < 1:
        raise ValueError(f"need cache_len >= 0 and tail_len >= 1, got {cache_len}, {tail_len}")
    prefix_len = cache_len + tail_len
    nodes = spec.num_nodes - 1
    total = prefix_len + nodes
    attend = torch.zeros(tail_len + nodes, total, dtype=torch.bool)
    tail_rows = torch.arange(tail_len)
    # Tail row i sees every cached token and tail tokens 0..i (causal).
    attend[:tail_len, :prefix_len] = (torch.arange(prefix_len)[None, :] <= (cache_len + tail_rows)[:, None])
    attend[tail_len:, :prefix_len] = True
    attend[tail_len:, prefix_len:] = tree_attention_mask(spec)
    positions = torch.cat([cache_len + tail_rows, prefix_len + tree_position_offsets(spec)])
    return attend, positions


def layer_node_ids(spec: TreeSpec, layer: int) -> range:
    """Node indices of ``layer`` (1..L)."""
    if not 1 <= layer <= spec.depth:
        raise ValueError(f"layer {layer} outside 1..{spec.depth}")
    return range(spec.layer_offsets[layer], spec.layer_offsets[layer + 1])


def draft_layer_inputs(spec: TreeSpec, layer: int, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and positions for the drafter's forward over the nodes of ``layer`` (Alg. 7).

    The cache holds the prefix and the nodes of layers 1..layer-1 in node order.
    Returns attend [W_l, prefix_len + offset_l - 1 + W_l] bool and positions [W_l] int64.
    """
    ids = layer_node_ids(spec, layer)
    fed_and_new = ids.stop - 1  # nodes 1 .. last node of this layer
    rows = tree_attention_mask(spec)[ids.start - 1 : ids.stop - 1, :fed_and_new]
    attend = torch.cat([torch.ones(len(ids), prefix_len, dtype=torch.bool), rows], dim=1)
    positions = prefix_len + spec.depths[ids.start : ids.stop] - 1
    return attend, positions


def path_cache_indices(prefix_len: int, accepted_nodes: list[int], fed_until: int) -> list[int]:
    """Cache positions to keep after a verdict: the prefix, then each accepted node that was fed.

    ``fed_until`` is one past the last node index that went through the model (the edge feeds all
    nodes; the drafter never feeds the last layer). Accepted nodes are in depth order, so the kept
    cache is exactly the KV of ``prefix + accepted path`` (minus an unfed leaf at the end).
    """
    kept = list(range(prefix_len))
    for node in accepted_nodes:
        if node < fed_until:
            kept.append(prefix_len + node - 1)
    return kept
