"""rlgate: gRPC clients, generated stubs and trainer adapters for the rlgate services."""

__version__ = "0.1.0"
