"""What the tests share: tiny models on disk (tiny_models), exact toy distributions (toy_models), a real
edge on a loopback port and the sessions run against it (harness), certificates (certs), a link that
can be cut (linkcut)."""
