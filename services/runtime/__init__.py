"""Shared server runtime: typed configuration, gRPC server bootstrap, logging, auth and metrics helpers.

Stdlib-only at import time where possible, so `rlgate <service> --help` works without the server extra.
"""
