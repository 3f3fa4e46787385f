"""Checkpoint candidates from graph structure (articulation points, separators) and their selection."""
