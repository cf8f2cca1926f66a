"""Developer tools, not the runtime: tiny real-architecture checkpoints to make and train (the `convert` extra)."""
