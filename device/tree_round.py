"""Token-tree rounds on the device (TSLT, "Multi-candidate DSD", Alg. 7): one batched drafter forward
per tree layer with tree attention; every node's k children are sampled i.i.d. with replacement from
the node's decoded packet, which is what the edge's recursive rejection sampling verifies against.
Trees are drafted after each verdict (never ahead); the edge answers with the accepted root path."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.common import verification as V
from specdec.common.protocol import Verdict
from specdec.common.streams import Purpose, stream
from specdec.common.tree import TreeSpec
from specdec.common.treeplan import path_cache_indices
from specdec.device.draft_model import DraftModel, EncodedQ
from specdec.device.drafting import RoundHost
from specdec.device.rounds import RoundDraft, RoundPlan


def draft(session: RoundHost, plan: RoundPlan, max_tokens: int) -> RoundDraft:
    """Draft the configured tree, cut to ``max_tokens`` layers (at least one)."""
    s, d = plan.settings, session.drafting
    config = s.tree[:max(1, min(len(s.tree), max_tokens))]
    spec = d.tree_spec(config)
    start = len(session.tokens)
    measured = []

    def encode(q: torch.Tensor) -> EncodedQ:
        enc = d.encode(q, s)
        measured.append(d.measure(q, enc, s))
        return enc

    tree = draft_tree(d.model, spec, session.tokens, encode, stream(d.hello.seed, Purpose.DRAFT, start))
    block = session.block(tuple(tree.nodes[1:]), s, distributions=tuple(e.payload for e in tree.encoded),
                          tree_depth=spec.depth)
    return RoundDraft(block=block, plan=plan, q_rows=[e.q_hat for e in tree.encoded],
                      theoretical_bits=sum(e.theoretical_bits for e in tree.encoded),
                      support_sizes=[e.support_size for e in tree.encoded], draft_seconds=tree.t_draft,
                      encode_seconds=tree.t_encode, start=start, tree=spec,
                      dropped=[e.dropped_mass for e in tree.encoded], q_stats=measured)


@dataclass(frozen=True)
class TreeCommit:
    """What a tree round's verdict decides; the session applies it."""
    new: list[int]                # the accepted root path's tokens and the next token
    cache: list[int]              # the draft cache entries kept: the prefix's and the path's fed nodes
    csqs_nodes: list[int]         # C-SQS (Alg. 1) updates along the path: the internal nodes tested


def commit(rd: RoundDraft, verdict: Verdict, next_token: int, verified: int) -> TreeCommit:
    """Follow the accepted root path of ``rd``'s tree, drafted after ``verified`` tokens."""
    spec = rd.tree
    path = list(verdict.accepted_nodes)
    if verdict.round_id != rd.block.round_id or not is_root_path(spec, path):
        raise ValueError(f"verdict path {path} is not a root path of round {rd.block.round_id}'s tree")
    nodes = (0, *rd.block.token_ids)
    fed_until = spec.layer_offsets[spec.depth]  # the last layer never went through the drafter
    tested = [n for n in [0, *path][: len(path) + 1] if n < spec.num_internal]
    return TreeCommit([nodes[n] for n in path] + [int(next_token)],
                      path_cache_indices(verified, path, fed_until), tested)


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
            q_layer = model.tree_layer_qs(spec, layer + 1, nodes, tokens)
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
