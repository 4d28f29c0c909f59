"""Generated protobuf code (`make proto`); the files here are git-ignored."""
