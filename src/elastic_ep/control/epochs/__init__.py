"""Epochs: a change of membership or placement (plan, transfers, verification) as a typed request with
a typed outcome, the background check of slots, and the rebalance towards a balanced placement."""
