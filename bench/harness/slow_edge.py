"""``edge-server`` on a slower edge: every target forward takes ``--target-slowdown`` times its own time.

The drafter-cost axis of bench-traces slows the drafter (a slower device); this slows the target, so
that the drafter costs less than this machine gives relative to the target (a device fast against its
edge: issue 46's 0.3x point, where the drafter here runs at ~0.4-0.55x the target). The forward's
own time is scaled, not a fixed delay added, so a batched forward or a prefill slows in proportion, as
on slower hardware. Sleeping, not computing: the cores the device shares here stay its own.

Run as ``python -m specdec.bench.harness.slow_edge --target-slowdown F [edge-server flags]``.
On CUDA the forward is synchronised before it is timed; CUDA-graph replays bypass the module's
forward and are not slowed (the bench runs on CPU).
"""
from __future__ import annotations

import sys
import threading
import time

import torch

from specdec.common.modeling import LoadedModel, ModelSpec, load_model
from specdec.bench.harness.rig import SLOW_EDGE_FLAG as FLAG
from specdec.common.runtime import OneLineParser, bounded
from specdec.edge.__main__ import main as edge_main


class ForwardSlowdown:
    """After each forward of ``module``, a sleep of ``factor - 1`` times that forward's own time.
    Per thread: the edge's workers may run forwards of their own at once (no batching)."""

    def __init__(self, module: torch.nn.Module, factor: float):
        if factor < 1:
            raise ValueError(f"a slowdown is at least 1, got {factor}")
        self.extra = factor - 1
        self._local = threading.local()
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    @staticmethod
    def _sync(module: torch.nn.Module) -> None:
        if next(module.parameters()).is_cuda:
            torch.cuda.synchronize()

    def _before(self, module, args) -> None:
        self._sync(module)
        self._local.t0 = time.perf_counter()

    def _after(self, module, args, output) -> None:
        self._sync(module)
        if self.extra > 0:
            time.sleep(self.extra * (time.perf_counter() - self._local.t0))


def slowed(factor: float, load=load_model):
    """``load`` whose model's forwards run ``factor`` times slower."""
    def load_slowed(spec: ModelSpec) -> LoadedModel:
        loaded = load(spec)
        ForwardSlowdown(loaded.model, factor)
        return loaded
    return load_slowed


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="slow-edge", allow_abbrev=False,
                      description="edge-server with its target's forwards slowed; other flags go to edge-server")
    p.add_argument(FLAG, type=bounded(float, 1.0), required=True, metavar="F",
                   help="each target forward takes F times its own time (F >= 1)")
    args, rest = p.parse_known_args(argv)
    return edge_main(rest, load=slowed(args.target_slowdown))


if __name__ == "__main__":
    sys.exit(main())
