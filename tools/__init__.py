"""Maintainers' tools, run from a source checkout (``python -m tools.<name>``) and never
installed: compile reports (Pallas Triton and Mosaic GPU for sm_90a, Mosaic TPU for v4-v6e),
libtpu's static cycle estimate and the Triton tile sweep. Their committed outputs live in
benchmarks/results/; benchmarks/ measures."""
