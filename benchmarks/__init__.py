"""Per-framework speed and memory of attention implementations: ``python -m benchmarks``.

Every implementation comes from ``conformance.registry`` (the one registry), every input from
``conformance.cases`` and every correctness verdict from ``conformance.tolerance`` against
``conformance.oracle``'s float64 reference; this package adds timing, memory, FLOP counts,
tables and plots.
"""
