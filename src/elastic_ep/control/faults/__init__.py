"""Faults: detection (signals in, typed faults out; the rules are pure), recovery from a fault to a new
epoch, and the straggler policy applied at step boundaries."""
