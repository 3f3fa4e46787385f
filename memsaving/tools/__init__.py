"""Commands, the demo, built-in models and memory timelines."""
