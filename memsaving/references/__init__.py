"""Exact references the planners are compared with: enumeration, MILP, layer graphs."""
