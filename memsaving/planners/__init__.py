"""Choosing what to keep, recompute or swap; the plan type every planner returns."""
