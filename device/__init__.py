"""specdec.device: the device client that runs the draft model and streams drafts to the edge."""
