"""Operating policies as pure functions over what the controller measures, shared by the
controller and the tools that judge or model a cluster (the doctor, `sim fleet`).
Imports nothing from the runtime side, only `errors`.

- `straggler`: the straggler verdict per rank (slow card vs DP imbalance vs not enough evidence).
- `straggler_policy`: what is done about a straggler (derate at once, evict when it stays slow,
  hysteresis, the cap, the floor, a group slowdown), and the flags that set it.
"""
