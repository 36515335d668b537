"""Operating policies as pure functions over what the controller measures, shared by the
controller and the tools that judge a running cluster (the doctor, and later `sim fleet`).
Imports nothing from the runtime side, only `errors`.

- `straggler`: the straggler verdict per rank (slow card vs DP imbalance vs not enough evidence).
"""
