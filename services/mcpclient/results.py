"""MCP `CallToolResult` -> `ToolResult`, output truncation, error results and tool-call log summaries.

Structured content is passed on as the JSON text of the value the upstream sent (`convert.json_text`):
integers stay integers, whatever their size."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

import mcp_types as mt

from rlgate.core.convert import InvalidJsonValue, json_text
from rlgate.core.redact import redact_urls
from rlgate.v1 import common_pb2

Kind = common_pb2.ToolErrorKind
TRUNCATION_MARKER = "\n…[output truncated by rlgate: {cut} of {total} bytes removed]"
ASK_FOR_LESS = "Ask for less (filters, pagination) if you need the rest"  # ends every OUTPUT_TRUNCATED message
# An error message past the output limit whose text the content also carries (cut to the limit there) is
# kept to its head in error_message, so a result holds it once, however long the tool or upstream made it.
ERROR_HEAD_BYTES = 1024
# Content blocks passed on per result. An upstream can send hundreds of thousands of empty blocks under its
# reply cap; each would be converted, measured and held, and none adds a byte for the output limit to cut.
MAX_CONTENT_BLOCKS = 1024


def _b64(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError):
        return data.encode()


def content_block(block: Any) -> common_pb2.ContentBlock:
    """One MCP content block as the wire `ContentBlock` (base64 payloads decoded to raw bytes)."""
    if isinstance(block, mt.TextContent):
        return common_pb2.ContentBlock(text=common_pb2.TextContent(text=block.text))
    if isinstance(block, mt.ImageContent):
        return common_pb2.ContentBlock(image=common_pb2.ImageContent(data=_b64(block.data), mime_type=block.mime_type))
    if isinstance(block, mt.AudioContent):
        return common_pb2.ContentBlock(audio=common_pb2.AudioContent(data=_b64(block.data), mime_type=block.mime_type))
    if isinstance(block, mt.ResourceLink):
        return common_pb2.ContentBlock(
            resource_link=common_pb2.ResourceLink(
                uri=str(block.uri),
                name=block.name,
                title=block.title or "",
                description=block.description or "",
                mime_type=block.mime_type or "",
                size=block.size or 0,
            )
        )
    if isinstance(block, mt.EmbeddedResource):
        res = block.resource
        embedded = common_pb2.EmbeddedResource(uri=str(res.uri), mime_type=res.mime_type or "")
        if isinstance(res, mt.TextResourceContents):
            embedded.text = res.text
        else:
            embedded.blob = _b64(res.blob)
        return common_pb2.ContentBlock(resource=embedded)
    # A block type this gateway does not know (newer protocol): keep it visible as JSON text.
    dump = block.model_dump(by_alias=True, mode="json") if hasattr(block, "model_dump") else block
    try:
        text = json_text(dump)
    except InvalidJsonValue:
        text = str(dump)
    return common_pb2.ContentBlock(text=common_pb2.TextContent(text=text))


def tool_result(result: mt.CallToolResult, max_bytes: int = 0) -> common_pb2.ToolResult:
    """Convert faithfully; an upstream isError becomes TOOL_FAILED with the tool's own text as message
    (cut to the output limit by `truncate`, as the output is).

    Two cuts happen here, before conversion, since converting would cost more than the result is allowed to
    carry: blocks past MAX_CONTENT_BLOCKS become one note, and structured content whose JSON is larger than
    `max_bytes` (the output limit; 0: none) is dropped unconverted (`truncate` would drop it anyway, after
    the exact conversion had walked every value of it on the event loop). Either sets OUTPUT_TRUNCATED on a
    result that is not an error."""
    out = common_pb2.ToolResult(
        content=[content_block(b) for b in result.content[:MAX_CONTENT_BLOCKS]], is_error=result.is_error
    )
    cuts: list[str] = []
    if (extra := len(result.content) - MAX_CONTENT_BLOCKS) > 0:
        cuts.append(f"{extra} content blocks past the first {MAX_CONTENT_BLOCKS} were omitted")
        out.content.append(_note(f"[{extra} more content blocks omitted by rlgate: at most {MAX_CONTENT_BLOCKS}]"))
    if result.structured_content is not None:
        if max_bytes > 0 and (size := _encoded_size(result.structured_content)) > max_bytes:
            cuts.append(f"the structured content ({size} bytes) exceeded {max_bytes} bytes and was dropped")
        else:
            try:
                out.structured_content_json = json_text(result.structured_content)
            except InvalidJsonValue as exc:  # e.g. NaN, which a lenient JSON parser let through upstream
                out.content.append(_note(f"[structured content omitted by rlgate: not valid JSON: {exc}]"))
    if result.is_error:
        out.error_kind = Kind.TOOL_ERROR_KIND_TOOL_FAILED
        text = " ".join(b.text for b in result.content[:MAX_CONTENT_BLOCKS] if isinstance(b, mt.TextContent))
        out.error_message = text.strip() or "the tool reported a failure without a message"
    elif cuts:
        out.error_kind = Kind.TOOL_ERROR_KIND_OUTPUT_TRUNCATED
        out.error_message = "output truncated: " + "; ".join(cuts) + f". {ASK_FOR_LESS}"
    return out


def _note(text: str) -> common_pb2.ContentBlock:
    return common_pb2.ContentBlock(text=common_pb2.TextContent(text=text))


def _encoded_size(value: Any) -> int:
    """The exact size of `value`'s compact JSON text, from the C encoder (no checks: this only decides whether
    the exact, checked conversion is worth running, and the agent is told the size); 0 for what it cannot
    encode (`json_text` then says why). Not the catalog's budgeted lower bound: that one runs on a worker
    thread and stops at its budget, this one names the size."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, check_circular=False)
    except (TypeError, ValueError, RecursionError):
        return 0
    return len(text.encode("utf-8", errors="surrogatepass"))


def error_result(kind: common_pb2.ToolErrorKind, message: str) -> common_pb2.ToolResult:
    """An agent-visible error: is_error, kind, and the message both as text content and error_message (a URL
    in it without what may carry a key)."""
    message = redact_urls(message)
    return common_pb2.ToolResult(
        content=[common_pb2.ContentBlock(text=common_pb2.TextContent(text=message))],
        is_error=True,
        error_kind=kind,
        error_message=message,
    )


def _block_size(block: common_pb2.ContentBlock) -> int:
    kind = block.WhichOneof("kind")
    if kind == "text":
        return len(block.text.text.encode())
    if kind == "image":
        return len(block.image.data)
    if kind == "audio":
        return len(block.audio.data)
    if kind == "resource":
        r = block.resource
        return len(r.blob) if r.WhichOneof("contents") == "blob" else len(r.text.encode())
    return block.ByteSize()


def _cut_utf8(text: str, limit: int) -> str:
    return text.encode()[: max(limit, 0)].decode("utf-8", errors="ignore")


def _cut_text(text: str, max_bytes: int) -> str:
    """`text` within `max_bytes` (UTF-8) plus the truncation marker, or `text` itself when it fits."""
    size = len(text.encode())
    if size <= max_bytes:
        return text
    kept = _cut_utf8(text, max_bytes)
    return kept + TRUNCATION_MARKER.format(cut=size - len(kept.encode()), total=size)


def truncate(result: common_pb2.ToolResult, max_bytes: int) -> common_pb2.ToolResult:
    """Cut content above `max_bytes` (text cut with a marker, binary blocks replaced by a note), drop a
    structured result larger than the limit and cut an error message longer than it (to its head of
    ERROR_HEAD_BYTES when the content carries its text). Sets OUTPUT_TRUNCATED unless the result is already
    an error."""
    if max_bytes <= 0:
        return result
    sizes = [_block_size(b) for b in result.content]
    structured = len(result.structured_content_json.encode())
    total = sum(sizes)
    long_message = len(result.error_message.encode()) > max_bytes
    if total <= max_bytes and structured <= max_bytes and not long_message:
        return result
    out = common_pb2.ToolResult()
    out.CopyFrom(result)
    if long_message:
        carried = any(b.WhichOneof("kind") == "text" and b.text.text for b in result.content)
        out.error_message = _cut_text(result.error_message, min(max_bytes, ERROR_HEAD_BYTES) if carried else max_bytes)
    if total <= max_bytes and structured <= max_bytes:
        return out  # only the message was cut: the output itself is whole
    removed = 0
    if total > max_bytes:
        del out.content[:]
        budget = max_bytes
        for block, size in zip(result.content, sizes, strict=True):
            if size <= budget:
                out.content.append(block)
                budget -= size
                continue
            removed += size - max(budget, 0) if block.WhichOneof("kind") == "text" else size
            if block.WhichOneof("kind") == "text":
                out.content.append(
                    common_pb2.ContentBlock(
                        text=common_pb2.TextContent(text=_cut_text(block.text.text, max(budget, 0)))
                    )
                )
            else:
                note = f"[{block.WhichOneof('kind')} block of {size} bytes omitted: output limit {max_bytes} bytes]"
                out.content.append(common_pb2.ContentBlock(text=common_pb2.TextContent(text=note)))
            budget = 0
    if structured > max_bytes:
        out.structured_content_json = ""
        removed += structured
    if not out.is_error:
        # What `tool_result` cut already (blocks past the count, structured content) stays said.
        before = result.error_message.removesuffix(f". {ASK_FOR_LESS}") + "; " if result.error_kind else ""
        out.error_kind = Kind.TOOL_ERROR_KIND_OUTPUT_TRUNCATED
        out.error_message = (
            f"{before}output exceeded {max_bytes} bytes and was truncated ({removed} bytes removed). {ASK_FOR_LESS}"
        )
    return out


def summary(result: common_pb2.ToolResult, limit: int = 500) -> str:
    """Short text for the tool-call log: the result's text (binary blocks as a note of their mime type, size
    and digest, never their bytes; the structured content when there is no text), whitespace collapsed, cut to
    `limit` characters."""
    parts: list[str] = []
    used = 0  # characters so far, a space after each part: the loop ends once past `limit`
    for block in result.content:
        before = len(parts)
        kind = block.WhichOneof("kind")
        if kind == "text":
            parts.append(block.text.text[:limit])
        elif kind == "image" or kind == "audio":
            media = getattr(block, kind)
            # Never the bytes: a screenshot adds this note to the log, and the digest tells screens apart.
            digest = hashlib.sha256(media.data).hexdigest()[:16]
            parts.append(f"[{kind}: {media.mime_type}, {len(media.data)} bytes, sha256:{digest}]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {block.resource_link.uri[:limit]}]")
        elif kind == "resource":
            res = block.resource
            contents = res.WhichOneof("contents")
            parts.append(
                res.text[:limit] if contents == "text" else f"[resource: {res.uri[:limit]}, {len(res.blob)} bytes]"
            )
        used += (len(parts[-1]) if len(parts) > before else 0) + 1  # an empty block costs a step too
        if used > limit:
            break
    text = " ".join(" ".join(parts).split())
    if not text:  # no text (or only blank blocks): what else the result says
        text = " ".join((result.structured_content_json[:limit] or result.error_message[:limit]).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
