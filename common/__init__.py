"""specdec.common: pure math and codecs shared by the device and the edge.

Convention for the whole repository: ``p`` is the target (edge, LLM) distribution and ``q`` the
draft (device, SLM) distribution. Nothing in the math modules touches a socket, a clock, a model
or a logger; randomness is passed in (a ``torch.Generator`` or pre-drawn uniforms).
"""
