"""Test and benchmark harnesses: real processes and real networks that tests and benchmarks
stand up and tear down themselves."""
