"""Fixtures for stack (filled in by its component)."""
