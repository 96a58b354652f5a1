"""MCP `CallToolResult` -> `ToolResult`, output truncation, error results and tool-call log summaries."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import mcp_types as mt

from rlgate.convert import fill_value
from rlgate.protocol import render_tool_result
from rlgate.v1 import common_pb2

Kind = common_pb2.ToolErrorKind
TRUNCATION_MARKER = "\n…[output truncated by rlgate: {cut} of {total} bytes removed]"


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
        return common_pb2.ContentBlock(resource_link=common_pb2.ResourceLink(
            uri=str(block.uri), name=block.name, title=block.title or "", description=block.description or "",
            mime_type=block.mime_type or "", size=block.size or 0,
        ))
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
    return common_pb2.ContentBlock(text=common_pb2.TextContent(text=json.dumps(dump)))


def tool_result(result: mt.CallToolResult) -> common_pb2.ToolResult:
    """Convert faithfully; an upstream isError becomes TOOL_FAILED with the tool's own text as message."""
    out = common_pb2.ToolResult(content=[content_block(b) for b in result.content], is_error=result.is_error)
    if result.structured_content is not None:
        fill_value(out.structured_content, result.structured_content, what="structured_content")
    if result.is_error:
        out.error_kind = Kind.TOOL_ERROR_KIND_TOOL_FAILED
        text = " ".join(b.text for b in result.content if isinstance(b, mt.TextContent)).strip()
        out.error_message = text[:2000] or "the tool reported a failure without a message"
    return out


def error_result(kind: int, message: str) -> common_pb2.ToolResult:
    """An agent-visible error: is_error, kind, and the message both as text content and error_message."""
    return common_pb2.ToolResult(
        content=[common_pb2.ContentBlock(text=common_pb2.TextContent(text=message))],
        is_error=True, error_kind=kind, error_message=message,  # type: ignore[arg-type]
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


def truncate(result: common_pb2.ToolResult, max_bytes: int) -> common_pb2.ToolResult:
    """Cut content above `max_bytes` (text cut with a marker, binary blocks replaced by a note) and drop a
    structured result larger than the limit. Sets OUTPUT_TRUNCATED unless the result is already an error."""
    if max_bytes <= 0:
        return result
    sizes = [_block_size(b) for b in result.content]
    structured = result.structured_content.ByteSize() if result.HasField("structured_content") else 0
    total = sum(sizes)
    if total <= max_bytes and structured <= max_bytes:
        return result
    out = common_pb2.ToolResult()
    out.CopyFrom(result)
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
                kept = _cut_utf8(block.text.text, budget)
                marker = TRUNCATION_MARKER.format(cut=size - len(kept.encode()), total=size)
                out.content.append(common_pb2.ContentBlock(text=common_pb2.TextContent(text=kept + marker)))
            else:
                note = f"[{block.WhichOneof('kind')} block of {size} bytes omitted: output limit {max_bytes} bytes]"
                out.content.append(common_pb2.ContentBlock(text=common_pb2.TextContent(text=note)))
            budget = 0
    if structured > max_bytes:
        out.ClearField("structured_content")
        removed += structured
    if not out.is_error:
        out.error_kind = Kind.TOOL_ERROR_KIND_OUTPUT_TRUNCATED
        out.error_message = (
            f"output exceeded {max_bytes} bytes and was truncated ({removed} bytes removed); "
            "ask for less (filters, pagination) if you need the rest"
        )
    return out


def summary(result: common_pb2.ToolResult, limit: int = 500) -> str:
    """Short text for the tool-call log: what the model sees (rlgate.protocol), cut to `limit`."""
    text = " ".join(render_tool_result(result).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
