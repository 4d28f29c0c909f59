"""Process plumbing shared by both entry points: the event loop, flag errors, torch's thread count,
and the gRPC transport settings the edge server and the device client must agree on."""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import math
import os
import socket
import sys
from dataclasses import dataclass

from specdec.common.validation import check_int, check_real

# edge-server and device-client on one host split its cores between them: two processes that each
# take every core fight over them in every forward, which costs far more than each having half.
PAIR_PROCESSES = 2
# At or below this many cores a process leaves the others to its peer even when the address does not
# say the peer is here (an edge bound to 0.0.0.0, a device given this host's public name): halving
# a lone process's threads costs it less than two oversubscribed processes lose.
FEW_CORES = 2

# Largest message either side accepts (the edge's --max-message-bytes default): a dense fp32 round
# over a 152k vocabulary with L = 32 is ~20 MB; the edge's limit on draft length keeps real rounds
# below this.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# HTTP/2 keepalive, the same on both ends: a peer that stops answering pings for KEEPALIVE_TIMEOUT_MS
# after KEEPALIVE_TIME_MS of silence is dropped, its stream breaks and its session detaches for a
# resume. So a silent dead link is noticed within 30 s even while no round is in flight, well inside
# the edge's 60 s resume window; pinging every 20 s stays above the 5 s the edge permits.
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000

# glibc's mallopt parameters (malloc.h): blocks below the mmap threshold come from the heap, and free
# heap memory above the trim threshold goes back to the system.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# A forward and its verification allocate tensors of ~1-30 MB each time (activations, the batch's
# rows of the target's law); glibc serves them with fresh mmaps, or trims them back as soon as they
# are freed, so every forward faults in and zeroes its pages again. Kept in the heap they are reused.
# glibc refuses an mmap threshold above 32 MB on 64-bit systems (HEAP_MAX_SIZE / 2); mallopt takes an int.
RETAINED_BLOCK_BYTES = 32 << 20
RETAINED_FREE_BYTES = (1 << 31) - 1


def run_async(coro):
    """Run ``coro`` on uvloop (falling back to asyncio's loop if uvloop cannot be imported)."""
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; this only guards exotic platforms
        return asyncio.run(coro)
    return uvloop.run(coro)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (``PROG: error: ...``) and exits with status 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def bounded(kind: type, low: float, high: float | None = None, *, low_open: bool = False):
    """The argparse type of a numeric flag of either command: the text as ``kind`` (int or float) in
    [low, high] (``low_open``: above low), floats finite, checked and worded by common/validation.py as
    the draft settings are; a bad value becomes OneLineParser's one line naming the flag."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a valid {kind.__name__}: {text!r}") from None
        try:
            if kind is int:
                check_int(value, "the value", low + int(low_open), high)
            else:
                check_real(value, "the value", low, math.inf if high is None else high, low_open=low_open)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value
    return parse


@dataclass(frozen=True)
class ThreadChoice:
    threads: int  # torch intra-op threads to set; 0 = keep torch's default
    reason: str   # why, for the one log line; "" when the user chose (--threads or OMP_NUM_THREADS)


def choose_threads(requested: int, cores: int, peer_on_host: bool, omp_env: str | None = None) -> ThreadChoice:
    """The torch thread count of one process of the pair: the one rule both CLIs use.

    ``requested``: --threads (0 = not given); ``cores``: cores this process may run on;
    ``peer_on_host``: the other process runs on this host too; ``omp_env``: $OMP_NUM_THREADS.
    """
    if requested > 0:
        return ThreadChoice(requested, "")
    if omp_env:  # torch's default already follows it
        return ThreadChoice(0, "")
    share = max(1, cores // PAIR_PROCESSES)
    if peer_on_host:
        return ThreadChoice(share, f"the edge and the device share this host's {cores} cores")
    if cores <= FEW_CORES:
        return ThreadChoice(share, f"only {cores} cores: leaving the rest to the other process, "
                                   "which may run here")
    return ThreadChoice(cores, f"the other process runs on another host: all {cores} cores")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def is_loopback(host: str) -> bool:
    """True for localhost and loopback literals (an edge bound there serves only this host)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_local_address(host: str) -> bool:
    """True if ``host`` resolves to loopback or to an address of this machine (a socket binds to it)."""
    if is_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if ip.is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def retain_freed_memory() -> bool:
    """Let freed blocks of up to RETAINED_BLOCK_BYTES stay in the process for the next forward, as
    tcmalloc or jemalloc would (a server's memory then stays at its high-water mark): on a CPU, page
    faults cost a batch's verification more than its arithmetic (docs/benchmarks.md). Returns False
    where the C library is not glibc or refuses (then nothing or part of it changed)."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, RETAINED_BLOCK_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, RETAINED_FREE_BYTES) == 1


def apply_threads(prog: str, requested: int, peer_on_host: bool) -> int:
    """Set torch's thread count by choose_threads; say what and why in one stderr line unless the user
    chose. Returns the threads torch now uses."""
    import torch

    choice = choose_threads(requested, usable_cores(), peer_on_host, os.environ.get("OMP_NUM_THREADS"))
    if choice.threads > 0:
        torch.set_num_threads(choice.threads)
    if choice.reason:
        sys.stderr.write(f"{prog}: {torch.get_num_threads()} torch thread(s): {choice.reason} "
                         "(--threads N overrides)\n")
    return torch.get_num_threads()
