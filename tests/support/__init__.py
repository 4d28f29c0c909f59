"""What the tests share: exact toy distributions (toy_models), a real edge on a loopback port and the
sessions run against it (harness), certificates (certs), a link that can be cut (linkcut). Tiny
checkpoints on disk come from specdec.testbed.tiny_models (the soak bench uses them too)."""
