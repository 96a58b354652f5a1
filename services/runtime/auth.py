"""Credentials on the wire: the bearer token of a request, the one way tokens and keys are hashed, and the
agent token's format (minted by the orchestrator, read by the gateway).

Both planes authenticate the same way (API keys on the orchestrator, agent tokens on the gateway), so the
parsing and the hash live here rather than in either plane or in the interceptors.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from typing import Protocol


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


# -- agent tokens ----------------------------------------------------------------------------------------
# An agent token names its session: `rlg1.<session_id>.<secret>`. The secret alone authenticates (the store
# finds a session by the token's hash); the session id only lets the gateway explain a token that no longer
# works (closed session, finished or superseded episode) by reading that session's revoked hashes, instead
# of answering UNAUTHENTICATED as for a token that was never issued. A session id is no secret.

AGENT_TOKEN_PREFIX = "rlg1"
MAX_TOKEN_SESSION_ID = 128  # characters of a session id read from a token
MAX_REVOKED_TOKENS = 16  # revoked token hashes a session keeps (oldest dropped): tokens older are UNAUTHENTICATED


class _TokenHolder(Protocol):
    token_hash: str
    episode: int
    revoked_tokens: dict[str, int]


def mint_agent_token(session_id: str) -> str:
    """A new agent token for a session (the orchestrator stores only its `token_hash`)."""
    return f"{AGENT_TOKEN_PREFIX}.{session_id}.{secrets.token_urlsafe(32)}"


def session_of_token(token: str) -> str | None:
    """The session id an agent token names, or None for a token not minted by `mint_agent_token`."""
    prefix, _, rest = token.partition(".")
    session_id, dot, secret = rest.rpartition(".")
    if prefix != AGENT_TOKEN_PREFIX or not dot or not session_id or not secret:
        return None
    return session_id if len(session_id) <= MAX_TOKEN_SESSION_ID else None


def revoke_agent_token(session: _TokenHolder) -> None:
    """Revoke `session`'s current agent token: `token_hash` becomes "" and the hash is kept, with the episode
    it belonged to, among the session's last MAX_REVOKED_TOKENS revoked ones (`revoked_tokens`, hash ->
    episode), so the gateway can say why the token stopped working. Call it wherever a token is cleared or
    replaced (a new episode, a repeated Reset's fresh token, close, expiry, failure). Assigns a new dict:
    records share containers with their copies."""
    if not session.token_hash:
        return
    revoked = {h: e for h, e in session.revoked_tokens.items() if h != session.token_hash}
    revoked[session.token_hash] = session.episode
    while len(revoked) > MAX_REVOKED_TOKENS:
        del revoked[next(iter(revoked))]
    session.revoked_tokens = revoked
    session.token_hash = ""
