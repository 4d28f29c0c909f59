"""bench-capacity (issue 19 item 4): many replayed devices against one edge-server process."""
