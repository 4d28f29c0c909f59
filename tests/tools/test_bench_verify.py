"""bench-verify: the per-session and the batched verification of one forward's rounds, on a small
vocabulary (the committed run uses the issue's 49152 and 128256)."""
from __future__ import annotations

import json

import pytest

from specdec.bench import bench_verify as bv


def test_a_small_run_compares_both_paths_and_writes_its_cells(tmp_path, capsys) -> None:
    out = tmp_path / "verify.json"
    assert bv.main(["--vocabs", "300", "--sessions", "1,4", "--drafts", "3", "--repeats", "1",
                    "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    cells = data["cells"]
    assert len(cells) == 2 * 3 * 2  # T x modes x sessions
    assert all(c["same_verdicts"] and c["per_session_s"] > 0 and c["batched_s"] > 0 for c in cells)
    assert any(0 < c["acceptance"] < 1 for c in cells)  # rounds both accept and reject
    assert data["goals"] == []  # the goal reads 32 sessions only
    assert "same verdicts True" in capsys.readouterr().out


def test_noise_ahead_times_the_verification_apart_from_the_draws(tmp_path, capsys) -> None:
    out = tmp_path / "verify.json"
    assert bv.main(["--vocabs", "300", "--sessions", "4", "--drafts", "3", "--repeats", "1", "--modes",
                    "gumbel,chain", "--noise-ahead", "--out", str(out)]) == 0
    cells = {(c["temperature"], c["mode"]): c for c in json.loads(out.read_text())["cells"]}
    for mode in ("gumbel", "chain"):
        ahead = cells[(1.0, mode)]
        assert ahead["same_verdicts"] and ahead["noise_ahead_verify_s"] > 0 and ahead["noise_ahead_draw_s"] > 0
        assert "noise_ahead_verify_s" not in cells[(0.0, mode)]  # T = 0 draws no noise
    assert "noise drawn ahead: verify" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--drafts", "0"], ["--vocabs", "10"], ["--modes", "tree"],
                                   ["--repeats", "0"]])
def test_bad_flags_exit_nonzero(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bv.parse_args(flags)
    assert e.value.code != 0
