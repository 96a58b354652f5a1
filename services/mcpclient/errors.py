"""What can go wrong talking to an upstream MCP endpoint, sorted by what a caller may do about it.

The gateway's promise that a tool never runs twice rests on this split: only `CallNotSent` is safe to retry;
`CallLost` and a sent `CallTimedOut` leave the outcome unknown; `CallRejected` (and `ReplyTooLarge`) mean the
upstream answered, so the call is over.
"""

from __future__ import annotations


class EndpointNotFound(Exception):
    """The endpoint answered HTTP 404: it does not exist on this instance (dropped, not an error)."""


class UpstreamUnavailable(Exception):
    """An MCP endpoint could not be reached or failed at the transport level."""


class CallNotSent(UpstreamUnavailable):
    """The call provably never reached the upstream (safe to retry, request record released)."""


class CallLost(UpstreamUnavailable):
    """The connection failed after the call may have been sent: the tool may or may not have run."""


class CallTimedOut(Exception):
    """The MCP call timeout (the caller's deadline) passed. `sent`: the request may have gone out (it was then
    cancelled upstream) and the tool may have partly run; otherwise it provably never started."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class CallRejected(Exception):
    """The upstream answered the call with an error instead of a tool result (`code`: its JSON-RPC code)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class ReplyTooLarge(CallRejected):
    """The upstream's reply grew past the reply limit: it was cut off unread and its connection dropped. The
    tool ran; its output is lost."""
