"""What every benchmark's figures share: the Agg backend, one colour per draft mode, small PNGs (they
are committed to docs/bench) and a provenance line under each figure."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 110
MODE_COLOURS = {"dense": "tab:red", "tslt": "tab:blue", "ksqs": "tab:green", "csqs": "tab:olive",
                "dssd": "tab:purple", "none": "tab:gray", "gumbel": "tab:orange"}


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def save(fig, path: Path, note: str = "") -> Path:
    """Lay out, write and close ``fig``; ``note`` (models, sample, revision) in small print at the bottom."""
    fig.tight_layout(rect=(0, 0.05 if note else 0, 1, 1))
    if note:
        fig.text(0.005, 0.005, note, fontsize=6, color="dimgray", ha="left", va="bottom", wrap=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
