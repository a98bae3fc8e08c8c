"""Shared fixtures for the pytest-benchmark suites (run: pytest bench/ --benchmark-only)."""
