"""The edge's scan for the device's end-of-sequence ids (edge/verifier.StopScan): the answer a scan of
the whole generated sequence gives, each token looked at once."""
from __future__ import annotations

from specdec.edge.verifier import StopScan


def test_the_scan_answers_as_a_whole_scan_and_looks_at_each_token_once() -> None:
    looked: list[int] = []

    class Counted(list):
        def __getitem__(self, i):
            looked.append(i)
            return super().__getitem__(i)

    scan, tokens = StopScan((9, 7)), Counted([7, 1, 2])  # the prompt (from 2 on: generated) may hold one
    assert not scan.reached(tokens, 2)
    tokens += [3, 4]
    assert not scan.reached(tokens, 2)
    tokens.append(9)
    assert scan.reached(tokens, 2) and scan.reached(tokens, 2)
    assert looked == [2, 3, 4, 5, 5]  # the hit is looked at again, nothing before it
    resynced = [7, 1, 2, 3]  # a resync replaces the list: scanned afresh
    assert not scan.reached(resynced, 2) and scan.reached(resynced + [7], 2)
    assert not StopScan(()).reached([9, 7], 0)  # no stop ids: never
