"""make bench-links: the pair over emulated real links (rate, round trip, jitter, loss, a link that
changes mid-session), edge-only vs fixed configurations vs ``mode auto`` (issue 18, item 4)."""
