"""bench-seeded's comparison and flags (the run itself needs edge-server processes on the embedded
target for many minutes: `make bench-seeded`)."""
from __future__ import annotations

import pytest

from specdec.bench import bench_seeded


def test_compare_counts_identical_sessions_and_where_the_others_first_differ() -> None:
    reference = [([1, 2, 3, 4], {"none": 1}, ["a"]), ([5, 6, 7], {"gumbel": 2}, ["a"])]
    got = [([1, 2, 9, 4], {"gumbel": 1}, ["a", "b"]), ([5, 6, 7], {"none": 1}, ["b"])]
    row = bench_seeded.compare(reference, got)
    assert row["identical_sessions"] == 1 and row["sessions"] == 2
    assert row["first_difference"] == [2]
    assert row["tokens_compared"] == 7
    assert row["rounds_by_mode"] == {"gumbel": 1, "none": 1} and row["moved_sessions"] == 1
    shorter = bench_seeded.compare(reference[:1], [([1, 2], {}, ["a"])])
    assert shorter["identical_sessions"] == 0 and shorter["first_difference"] == [2]


def test_summary_passes_only_when_every_session_of_every_run_is_identical() -> None:
    runs = [{"identical_sessions": 8, "sessions": 8, "tokens_compared": 192},
            {"identical_sessions": 7, "sessions": 8, "tokens_compared": 192}]
    s = bench_seeded.summarize({"scenarios": {"load-8": runs, "load-1": runs[:1]}})
    assert s["load-8"]["identical_sessions"] == 15 and not s["load-8"]["all_identical"]
    assert s["load-1"]["all_identical"] and s["load-1"]["tokens_compared"] == 192


@pytest.mark.parametrize("args", [["--scenarios", "load-2"], ["--runs", "0"]])
def test_bad_arguments_exit_with_one_line(args, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench_seeded.parse_args(args)
    assert exit_.value.code == 2
    assert len([line for line in capsys.readouterr().err.splitlines() if "error" in line]) == 1
