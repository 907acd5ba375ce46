"""Benchmarks run by hand on a GPU machine (`python -m bench.gpu`); not tests."""
