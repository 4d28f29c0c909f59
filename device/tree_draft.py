"""Token-tree rounds on the device (TSLT, "Multi-candidate DSD", Alg. 7): one batched drafter forward
per tree layer with tree attention; every node's k children are sampled i.i.d. with replacement from
the node's decoded packet, which is what the edge's recursive rejection sampling verifies against."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.common import verification as V
from specdec.common.tree import TreeSpec
from specdec.device.draft_model import DraftModel, EncodedQ


@dataclass(frozen=True)
class TreeDraft:
    spec: TreeSpec
    nodes: list[int]                # [num_nodes] token per node (entry 0, the root, unused)
    encoded: list[EncodedQ]         # [num_internal] one packet per internal node, in node order
    t_draft: float
    t_encode: float


def draft_tree(model: DraftModel, spec: TreeSpec, tokens: list[int], encode: Callable[[torch.Tensor], EncodedQ],
               generator: torch.Generator) -> TreeDraft:
    """Draft ``spec`` after the verified ``tokens``; ``encode`` turns a node's q into its packet."""
    nodes = [0] * spec.num_nodes
    encoded: list[EncodedQ] = []
    t_draft = t_encode = 0.0
    t0 = time.perf_counter()
    q_layer = [model.q_after(tokens)]  # layer 0: the root's q, after the prefix
    t_draft += time.perf_counter() - t0
    for layer in range(spec.depth):
        parents = range(spec.layer_offsets[layer], spec.layer_offsets[layer + 1])
        for parent, q in zip(parents, q_layer):
            t1 = time.perf_counter()
            enc = encode(q)
            kids = spec.children(parent)
            t2 = time.perf_counter()
            picks = V.sample_candidates(enc.q_hat, len(kids), generator, with_replacement=True)
            nodes[kids.start:kids.stop] = picks.tolist()
            t_encode += t2 - t1
            t_draft += time.perf_counter() - t2
            encoded.append(enc)
        if layer + 1 < spec.depth:
            t3 = time.perf_counter()
            q_layer = model.tree_layer_qs(spec, layer + 1, nodes, len(tokens))
            t_draft += time.perf_counter() - t3
    return TreeDraft(spec, nodes, encoded, t_draft, t_encode)


def is_root_path(spec: TreeSpec, path: list[int]) -> bool:
    """True iff ``path`` walks from the root down parent -> child (node indices, depth order)."""
    parent = 0
    for node in path:
        if not 0 < node < spec.num_nodes or int(spec.parents[node]) != parent:
            return False
        parent = node
    return True
