"""Trainer adapters: SkyRL (rlgate.adapters.skyrl) and Tinker (rlgate.adapters.tinker)."""
