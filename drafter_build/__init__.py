"""The build of the default drafter's files (``make drafter``): data from the target, the reduced head,
the files in device/drafter_weights/, and what they achieve on held-out answers."""
