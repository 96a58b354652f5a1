"""Fixtures for redis (filled in by its component)."""
