"""make bench-traces: the pair over recorded cellular links (Mahimahi traces of LTE up- and downlinks),
edge-only vs the fixed default vs the links grid's best fixed configuration vs ``mode auto``
(issue 35, item 2)."""
