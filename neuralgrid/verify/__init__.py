"""Model verification by challenge: score a node's greedy answers against a trusted reference run."""
