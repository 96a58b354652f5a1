"""Credentials on the wire: the bearer token of a request, and the one way tokens and keys are hashed.

Both planes authenticate the same way (API keys on the orchestrator, agent tokens on the gateway), so the
parsing and the hash live here rather than in either plane or in the interceptors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` header, or None."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value if isinstance(value, str) else value.decode("latin-1")
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def token_hash(token: str) -> str:
    """How tokens and keys are stored and compared: SHA-256 hex. Never store or log the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()
