"""The benchmark suite: named sweeps of the boundaries (``benchmarks.sweeps``) and one runner
(``python -m benchmarks.run``) appending tidy rows to one CSV. See benchmarks/README.md."""
