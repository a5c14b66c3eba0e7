"""Benchmarks with recorded results; each module has `main(argv) -> dict` and prints one JSON line last."""
