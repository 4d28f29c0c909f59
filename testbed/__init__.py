"""The lab around the product: two network namespaces joined by a shaped veth pair, the processes
run in them, and tiny checkpoints to run them with.

- :mod:`testbed.netns`: namespaces, veth, ``tc`` shaping (``netem`` where the kernel has it, else
  ``tbf`` for the rate), and the detection of which is in use.
- :mod:`testbed.linkemu`: a userspace link emulator (asyncio TCP proxy) for delay, jitter and loss
  where ``netem`` is missing; it also limits the rate, so it works without root on loopback.
- :mod:`testbed.probe`: measures what a link actually does (rate per direction, one-way delays).
- :mod:`testbed.tiny_models`: tiny random causal LMs saved as real HF checkpoints (tests, the soak bench).
- ``python -m specdec.testbed`` (``make testbed``): edge-server in one namespace, device-client in the other.

Traffic stays on loopback or inside the namespaces created here (198.18.0.0/15 is reserved for
benchmarking, RFC 2544; the namespaces have no route anywhere else).
"""
