"""Serving benchmarks: workloads, a load generator, metrics as pure functions, side-by-side ratios, reports.

The flow is workload -> load generator (closed or open loop) -> per-request timestamp records ->
metrics -> report. Anything that streams tokens (the in-process engine, a Triton endpoint, a peer
engine) plugs in as a `load.Target`.
"""
