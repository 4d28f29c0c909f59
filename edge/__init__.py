"""specdec.edge: the edge server that runs the target model and verifies drafts."""
