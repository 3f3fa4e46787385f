"""Replaying a plan on the graph model: actions, the simulator, swap timing, executor orders."""
