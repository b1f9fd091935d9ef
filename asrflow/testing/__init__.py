"""Helpers for tests and benchmarks that ship with the package (generated corpora)."""
