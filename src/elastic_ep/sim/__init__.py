"""Fleet-scale reliability models: blast radius, expert redundancy, fleet simulation, planner.

Pure code over numpy (no torch), so `elastic-ep sim` and `elastic-ep plan` start fast.
The worked tables of seed 001 are this package's test vectors.
"""
