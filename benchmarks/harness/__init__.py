"""What our own benchmark scripts (scripts/bench_*.py, `make bench`) hold llmpipe to; not part of the package."""
