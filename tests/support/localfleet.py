"""Fixtures for localfleet (filled in by its component)."""
