"""The one rule that sets each process's torch threads when no flag does (common/runtime.py)."""
from __future__ import annotations

import socket

import pytest

from specdec.common.runtime import FEW_CORES, PAIR_PROCESSES, choose_threads, is_local_address, is_loopback


@pytest.mark.parametrize("cores, peer_on_host, threads", [
    (2, True, 1), (8, True, 4), (1, True, 1), (3, True, 1),   # the pair splits the host
    (2, False, 1), (1, False, 1),                             # few cores: assume the peer may be here
    (8, False, 8), (3, False, 3),                             # peer elsewhere: every core
])
def test_default_threads_share_the_cores(cores, peer_on_host, threads) -> None:
    choice = choose_threads(0, cores, peer_on_host)
    assert choice.threads == threads
    assert choice.reason  # an automatic choice is always explained


def test_the_pair_never_oversubscribes_a_shared_host() -> None:
    for cores in range(1, 65):
        assert PAIR_PROCESSES * choose_threads(0, cores, True).threads <= max(cores, PAIR_PROCESSES)
        if cores <= FEW_CORES:
            assert choose_threads(0, cores, False).threads == choose_threads(0, cores, True).threads


@pytest.mark.parametrize("omp", [None, "3"])
def test_threads_flag_overrides_everything(omp) -> None:
    assert choose_threads(5, 2, True, omp).threads == 5
    assert choose_threads(5, 2, True, omp).reason == ""


def test_omp_num_threads_keeps_torch_default_silently() -> None:
    assert choose_threads(0, 2, True, "1").threads == 0
    assert choose_threads(0, 2, True, "1").reason == ""


def _unresolvable(host, *args, **kwargs):
    raise socket.gaierror(socket.EAI_NONAME, f"{host}: Name or service not known")


@pytest.mark.parametrize("host, expected", [
    ("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LocalHost", True), ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("edge.example", False),
])
def test_is_loopback(host, expected) -> None:
    assert is_loopback(host) is expected


def test_local_address_is_loopback_or_an_address_of_this_host(monkeypatch) -> None:
    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1 (a literal: no lookup): never assigned to a host
    with monkeypatch.context() as m:  # a name the resolver cannot find, without asking a real resolver
        m.setattr(socket, "getaddrinfo", _unresolvable)
        assert not is_local_address("edge.example")  # unresolvable: treated as remote
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # picks the outgoing interface, sends nothing
        except OSError:
            pytest.skip("no non-loopback route on this host")
        own = s.getsockname()[0]
    assert is_local_address(own)


# A fresh process allocates an 8 MB tensor and prints whether it lies in the heap (brk) rather than
# in a mapping of its own (fresh: a test worker's heap and glibc's dynamic threshold hold whatever
# earlier tests left in them).
IN_HEAP_SCRIPT = """
import sys, torch
from specdec.common.runtime import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory() is True
block = torch.ones(2 << 20)
heap = next(line for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
low, high = (int(x, 16) for x in heap.split()[0].split("-"))
print(int(low <= block.data_ptr() < high))
"""


def test_the_edge_keeps_freed_memory_for_its_next_forward() -> None:
    """glibc (this machine's, CI's) takes both settings, and an 8 MB block then comes from the heap,
    which keeps it when it is freed, where glibc's defaults map it on its own and unmap it when freed
    (so the next one faults all its pages in again). Whether a kept page stays resident is the
    kernel's business (this VM's DAMON pages out cold memory), so the test reads where the block
    lies, not its page faults."""
    import subprocess
    import sys

    def in_heap(mode: str) -> bool:
        out = subprocess.run([sys.executable, "-c", IN_HEAP_SCRIPT, mode], capture_output=True, text=True, check=True)
        return out.stdout.split()[-1] == "1"

    assert not in_heap("default"), "glibc's defaults already put an 8 MB block in the heap: nothing to compare"
    assert in_heap("retain")
