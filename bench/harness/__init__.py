"""The one harness every benchmark runs on.

- :mod:`.rig`: edge-server and device driver processes for a whole run, over a chosen link
  (loopback, tbf-shaped namespaces, or the userspace emulator), several edges or drivers at once;
- :mod:`.driver`: the device driver process (the default drafter loaded once, sessions as
  device-client runs them, with per-round logs on request);
- :mod:`.plan`: prompts and seeds, the balanced order configurations take turns in, run folders and
  what a run records about the machine and the code;
- :mod:`.analyze`, :mod:`.plots`: sums over sessions, ratios, goals and their report; figures.
"""
