"""URLs without what may carry a credential, for text that leaves the process: logs, error messages, spans
and the tool specs an agent sees.

An MCP endpoint URL is the operator's (a task file, a Fleet instance) and may carry a key in its userinfo
(`https://user:key@host/...`) or its query (`?token=...`). Routing keeps the URL whole; everything that
shows it shows scheme, host, port and path only, and marks a removed query with `?…`.
"""

from __future__ import annotations

import re

# scheme://[userinfo@]host[:port][path][?query][#fragment], up to the next whitespace or quote. The scheme
# and userinfo are bounded so that a failed match costs a bounded look ahead (linear in the text overall,
# whatever an upstream put in a message).
_URL = re.compile(
    r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]{0,31}://)(?P<userinfo>[^\s/?#@'\"]{0,512}@)?(?P<rest>[^\s?#'\"]*)"
    r"(?P<query>\?[^\s#'\"]*)?(?P<fragment>#[^\s'\"]*)?"
)
QUERY_MARK = "?…"


_TRAILING = re.compile(r"[.,:;!)\]]+$")  # a sentence's punctuation after a URL stays in the sentence


def _public(match: re.Match[str]) -> str:
    removed = (match["query"] or "") + (match["fragment"] or "")
    if not removed:
        return match["scheme"] + match["rest"]
    trailing = _TRAILING.search(removed)
    return match["scheme"] + match["rest"] + QUERY_MARK + (trailing.group() if trailing else "")


def public_url(url: str) -> str:
    """`url` without userinfo, query and fragment (a removed query or fragment shown as `?…`).

    Args:
        url: the URL, as configured or received.
    """
    return _URL.sub(_public, url)


def redact_urls(text: str) -> str:
    """`text` with every URL in it shown by `public_url` (cheap when there is none).

    Args:
        text: free text, such as a log message or an upstream's error.
    """
    return _URL.sub(_public, text) if "://" in text else text
