"""The channel pool of a client: one channel per address, used round-robin, made on first use.

The channels are sync (`grpc.Channel`) or asyncio (`grpc.aio.Channel`) as the factory makes them; the
pool only picks, caches and hands them back for closing."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc

C = TypeVar("C")


class Pool(Generic[C]):
    """Round-robin over one channel per address; channels (and their stubs) are made on first use.

    Args:
        addresses: one or more `host:port` addresses.
        factory: makes the channel to an address (`sync_channel` or `aio_channel`, partially applied).
    """

    def __init__(self, addresses: Sequence[str], factory: Callable[[str], C]) -> None:
        self.addresses = tuple(addresses)
        self._factory = factory
        self._channels: dict[str, C] = {}
        # A stub builds a callable per RPC of its service: built once per channel, not once per call.
        self._stubs: dict[tuple[str, type], Any] = {}
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def _channel(self, address: str) -> C:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._factory(address)
        return channel

    def next_stub(self, stub_class: type) -> Any:
        """A stub on the next channel in turn (one stub per channel and class).

        Args:
            stub_class: a generated stub class, such as `OrchestratorServiceStub`.
        """
        with self._lock:
            address = self.addresses[next(self._counter) % len(self.addresses)]
            stub = self._stubs.get((address, stub_class))
            if stub is None:
                stub = self._stubs[(address, stub_class)] = stub_class(self._channel(address))
            return stub

    def take_channels(self) -> list[C]:
        """Every channel made so far, handed over for closing (the pool starts afresh)."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            self._stubs.clear()
            return channels


def sync_channel(address: str, creds: grpc.ChannelCredentials | None, options: list[Any]) -> grpc.Channel:
    """A blocking channel to `address`: TLS with `creds`, else plaintext.

    Args:
        address: `host:port`.
        creds: TLS credentials; None for plaintext.
        options: gRPC channel options.
    """
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, creds, options=options)


def aio_channel(address: str, creds: grpc.ChannelCredentials | None, options: list[Any]) -> grpc.aio.Channel:
    """An asyncio channel to `address` (it belongs to the running event loop): TLS with `creds`, else plaintext.

    Args:
        address: `host:port`.
        creds: TLS credentials; None for plaintext.
        options: gRPC channel options.
    """
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)
