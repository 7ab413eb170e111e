"""A stage's trained state at rest and in transit: its wire codec, state sync between peers, local checkpoints."""
