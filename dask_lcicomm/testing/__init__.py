"""Helpers for tests and benchmarks of lci:// (not needed at run time)."""
