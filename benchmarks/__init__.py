"""The benchmark suite of mprs_plus; ``python benchmarks/run.py --help``."""
