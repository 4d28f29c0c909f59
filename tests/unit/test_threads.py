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


def test_the_edge_keeps_freed_memory_for_its_next_forward() -> None:
    """glibc (this machine, CI's) takes both settings; a freed 8 MB block then comes back without
    faulting its pages in again (a fresh mmap would fault in all 2048 of them)."""
    import resource

    import torch

    from specdec.common.runtime import retain_freed_memory

    assert retain_freed_memory() is True
    block = 8 << 20
    held = torch.ones(block // 4)
    del held  # the heap grew to hold it, and keeps it now that it is freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(block // 4)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < block // 4096 // 4
