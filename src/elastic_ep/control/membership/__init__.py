"""Membership: node agents and the rank processes they run, warm standbys, scaling (rules and driver), the
nodes' host-memory backups and hardware signals."""
