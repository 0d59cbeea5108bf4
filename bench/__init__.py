"""Benchmarks of ftis-kernels against the PyTorch reference and the peers (see bench/README.md).

`python -m bench.run --device cuda|cpu --out DIR` writes results.json, a markdown table and PNG
plots drawn from the JSON; `pytest bench/` runs the same implementations under pytest-benchmark.
"""
