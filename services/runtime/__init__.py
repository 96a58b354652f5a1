"""The services' kernel: typed configuration, gRPC server bootstrap, interceptors, logging, auth and metrics
helpers, the process identity. Tooling on top of the services lives in rlgate.devtools, not here.

Stdlib-only at import time where possible, so `rlgate <service> --help` works without the server extra.
"""
