"""elastic-ep: a fault-tolerant, elastic serving runtime for Mixture-of-Experts models."""

__version__ = "0.1.0"
