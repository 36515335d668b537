"""Serving: the scheduler and its DP alignment rules, one step across the members, the streams back to
clients, the isolation of a request that breaks its steps, the expert-load recorder."""
