"""What a device remembers about each edge across sessions and processes, as the kernel keeps TCP
metrics per destination (``ip tcp_metrics``): mode auto's estimates (device/tracker_state.py's record, from
:meth:`~specdec.device.auto.LinkTracker.snapshot`), so that a new process starts from what the
last ones learned instead of from priors (a cold start: ``device-client`` is one process per run).

One JSON file per edge address under ``$SPECDEC_CACHE_DIR/edges/``:
``{"version", "edge", "link": {"saved", "state"}, "drafters": {name: {"saved", "state"}}}``. The link
part (round trip, goodput, the edge's forward times) describes where the device was: it is used for
LINK_TTL_S (Linux forgets a destination's metrics after an hour, TCP_METRICS_TIMEOUT). The model part
(acceptance of this drafter with this edge's target, the drafter's speed) is per drafter and kept for
MODEL_TTL_S. Mode auto's safety net (what edge-only and drafted rounds delivered, device/safety_net.py)
depends on both: it is kept with the link, for the drafter that measured it only. Everything in it
was learned from committed rounds (RoundEvents) only.

Robust: a file that is missing, unreadable, of another version or malformed in any field is ignored
(the device starts cold and overwrites it); writers take an exclusive lock on a side file, merge
with what is there (other drafters' parts are kept) and replace the file atomically, so concurrent
processes never read a half-written file and the last to finish a session wins.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path

from specdec.common.modeling import cache_root
from specdec.device import tracker_state
from specdec.device.auto import LinkTracker

log = logging.getLogger("specdec.device")

VERSION = 1
LINK_TTL_S = 3600.0          # a link estimate this old describes where the device was, not where it is
MODEL_TTL_S = 7 * 86400.0    # the drafter and the target change with releases, not by the hour
MAX_FILE_BYTES = 1 << 20     # a memory file is a few KB; anything larger is not ours
NETS_DRAFTER = "nets_drafter"  # in the link part: the drafter whose rounds the safety net's sums measured


def memory_dir() -> Path:
    return cache_root() / "edges"


def memory_path(edge: str, root: Path | None = None) -> Path:
    """The file of one edge address (readable name, hashed for uniqueness)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", edge)[:64]
    digest = hashlib.sha256(edge.encode()).hexdigest()[:12]
    return (root or memory_dir()) / f"{slug}-{digest}.json"


def _read(path: Path) -> dict | None:
    """The file's content if it is a memory file of this version, else None (logged once)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError("too large")
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not version {VERSION}")
        return data
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring the edge memory in %s: %s", path, exc)
        return None


def load(tracker: LinkTracker, edge: str, drafter: str, root: Path | None = None, now: float | None = None) -> list[str]:
    """Start ``tracker`` from what is remembered of ``edge`` with ``drafter``; the parts restored
    (``link``, ``models``), none if nothing usable is remembered."""
    data = _read(memory_path(edge, root))
    if data is None:
        return []
    now = time.time() if now is None else now
    link = _own_nets(_fresh(data.get("link"), LINK_TTL_S, now), drafter)
    models = _fresh((data.get("drafters") or {}).get(drafter), MODEL_TTL_S, now)
    try:
        state = tracker_state.from_json({"link": link, "models": models})
    except ValueError as exc:
        log.warning("ignoring a malformed edge memory for %s: %s", edge, exc)
        return []
    tracker.restore(state)
    return [name for name, part in (("link", link), ("models", models)) if part is not None]


def _own_nets(link: dict | None, drafter: str) -> dict | None:
    """The link part, without the safety net's sums if another drafter measured them (its drafted
    rounds' speed is that drafter's)."""
    if link is None or link.get(NETS_DRAFTER) == drafter:
        return link
    return {k: v for k, v in link.items() if k not in ("nets", NETS_DRAFTER)}


def _fresh(part, ttl: float, now: float) -> dict | None:
    if not isinstance(part, dict) or not isinstance(part.get("state"), dict):
        return None
    saved = part.get("saved")
    if not isinstance(saved, (int, float)) or now - saved > ttl:  # (a save "after" now: another process
        return None                                                # stamped it while this one waited)
    return part["state"]


def save(tracker: LinkTracker, edge: str, drafter: str, root: Path | None = None, now: float | None = None) -> None:
    """Remember what ``tracker`` knows of ``edge`` (I/O errors are logged, never raised: a device
    whose cache is read-only still works)."""
    path = memory_path(edge, root)
    now = time.time() if now is None else now
    state = tracker_state.to_json(tracker.snapshot())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            data = _read(path) or {}
            drafters = {k: v for k, v in (data.get("drafters") or {}).items()
                        if isinstance(v, dict) and _fresh(v, MODEL_TTL_S, now) is not None}
            drafters[drafter] = {"saved": now, "state": state["models"]}
            link = None if state["link"] is None else {**state["link"], NETS_DRAFTER: drafter}
            _write(path, {"version": VERSION, "edge": edge, "link": {"saved": now, "state": link},
                          "drafters": drafters})
    except OSError as exc:
        log.warning("could not save the edge memory in %s: %s", path, exc)


@contextlib.contextmanager
def _locked(path: Path):
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
