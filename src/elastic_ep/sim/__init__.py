"""Fleet-scale reliability models: blast radius, expert redundancy, fleet simulation, planner.

Pure code over numpy (no torch), so `elastic-ep sim` and `elastic-ep plan` start fast.
Worked tables of reference deployments are its test vectors (tests/sim).
"""
