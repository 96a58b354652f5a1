r"""The text protocol between a model and rlgate tools (Hermes / Qwen style).

- `render_system_prompt(tools)`: the `<tools>` JSON block, the `<tool_call>` instructions and the ending
  convention (`<final_answer>...</final_answer>`, or `<done/>` when there is nothing to answer).
- `parse_assistant_text(text)`: the tool calls, final answer and done signal of one assistant turn. It
  accepts what models actually write: several calls per turn, `name`/`tool` and `arguments`/`params`
  spellings (and OpenAI's `{"function": {...}}`), arguments as a JSON string, a missing `</tool_call>`, up to
  three missing closing braces, code fences, prose and `<think>` blocks around the calls. It never raises:
  what cannot be parsed comes back in `ParsedTurn.errors`, which the adapters show the model as an
  observation. That includes text no RPC can carry: a lone UTF-16 surrogate (what JSON's `"\ud800"`
  escape decodes to) in a tool name, in arguments or in the final answer is a parse error, since gRPC
  strings must be valid UTF-8; `sendable_text` makes the rest of the turn's text sendable (U+FFFD in place
  of each lone surrogate).
- `tool_result_parts` / `tool_response_message`: tool results (MCP content blocks) as `<tool_response>`
  text with each image in place as an `ImagePart` (`rlgate.messages`): an image block, and a text block
  that is exactly `{"base64_image": "data:image/...;base64,..."}` (what some screenshot tools answer,
  Fleet's among them). Audio and binary resources are noted, not inlined. `render_tool_result` is the same
  as text, each image a placeholder.

Schemas and structured results come from rlgate's JSON text fields, so what the model reads is exactly what
the MCP server wrote (integers stay integers).

Pure functions on plain data: the clients, adapters and `rlgate rollout` share them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlgate.core.convert import InvalidJsonValue, json_text, parse_json_object
from rlgate.messages import ImagePart, Message, Part, TextPart, UnreadableImage

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FINAL_OPEN = "<final_answer>"
FINAL_CLOSE = "</final_answer>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
MAX_MISSING_BRACES = 3
_MAX_CUTS = 20

_NAME_KEYS = ("name", "tool", "tool_name", "function_name")
_ARGUMENT_KEYS = ("arguments", "params", "parameters", "args", "input")
_DONE_RE = re.compile(r"<done\s*/?>", re.IGNORECASE)
_MARKER_RE = re.compile(
    r"<tool_call>|<think>|<final_answer>|<done\s*/?>",
    re.IGNORECASE,
)
_DECODER = json.JSONDecoder()
_SURROGATE_RE = re.compile(r"[\ud800-\udfff]")

DEFAULT_INSTRUCTIONS = "You are an agent that completes tasks by calling tools."

FORMAT_REMINDER = (
    'Call a tool as <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>, '
    f"or finish with {FINAL_OPEN}your answer{FINAL_CLOSE} (or <done/> if there is nothing to answer)."
)


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the model wrote it.

    Args:
        name: the tool's name.
        arguments: the call's arguments, a JSON object.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParsedTurn:
    """What one assistant message asks for.

    Args:
        tool_calls: the calls, in the order the model wrote them.
        final_answer: the final answer's text, if the message gave one.
        done: the model ended the episode: a final answer or <done/>.
        errors: one message per block that could not be parsed (shown to the model; never raised).
    """

    tool_calls: list[ToolCall] = field(default_factory=list)
    final_answer: str | None = None
    done: bool = False
    errors: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """No call, no ending and no error: the model wrote only prose."""
        return not self.tool_calls and not self.done and not self.errors


# --------------------------------------------------------------------------------------------- rendering


def tool_spec_dict(spec: Any) -> dict[str, Any]:
    """A tool as `{"name", "description", "parameters"}`.

    Args:
        spec: a rlgate ToolSpec, or a mapping with `name`, `description` and `parameters` (or `input_schema`,
            `inputSchema`).

    Raises:
        InvalidJsonValue: a ToolSpec whose `input_schema_json` is not a JSON object.
    """
    if isinstance(spec, Mapping):
        params = spec.get("parameters", spec.get("input_schema", spec.get("inputSchema")))
        return {
            "name": str(spec.get("name", "")),
            "description": str(spec.get("description", "") or ""),
            "parameters": dict(params) if isinstance(params, Mapping) else {"type": "object", "properties": {}},
        }
    # The schema exactly as the MCP server wrote it: the model sees `"default": 3`, never 3.0.
    params = parse_json_object(spec.input_schema_json, f"input_schema_json of tool {spec.name!r}")
    return {
        "name": spec.name,
        "description": spec.description,
        "parameters": params or {"type": "object", "properties": {}},
    }


def render_tools_block(tools: Iterable[Any]) -> str:
    """The `<tools>` block of the system prompt: one JSON function signature per line.

    Args:
        tools: ToolSpecs or mappings, as `tool_spec_dict` takes them.
    """
    lines = [
        json.dumps({"type": "function", "function": tool_spec_dict(t)}, ensure_ascii=False, sort_keys=False)
        for t in tools
    ]
    return "<tools>\n" + "\n".join(lines) + "\n</tools>"


def render_system_prompt(tools: Iterable[Any], instructions: str = DEFAULT_INSTRUCTIONS) -> str:
    """The system prompt: instructions, the tool signatures and the call/finish conventions.

    Args:
        tools: ToolSpecs or mappings, as `tool_spec_dict` takes them.
        instructions: the text before the tools; empty for none.
    """
    head = instructions.strip() + "\n\n" if instructions.strip() else ""
    return (
        f"{head}# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"{render_tools_block(tools)}\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
        "Each tool result comes back inside <tool_response></tool_response> tags. When the task is complete, "
        f"give your final answer as {FINAL_OPEN}answer{FINAL_CLOSE}; if the task needs no answer, "
        "reply <done/>."
    )


def render_tool_call(call: ToolCall, *, name_key: str = "name", arguments_key: str = "arguments") -> str:
    """`call` as a `<tool_call>` block, as a model would write it.

    Args:
        call: the call.
        name_key: the key of the tool's name (other spellings for parser tests).
        arguments_key: the key of the arguments.
    """
    payload = {name_key: call.name, arguments_key: call.arguments}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(payload, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def render_final_answer(answer: str) -> str:
    """`answer` in the final-answer tags that end an episode.

    Args:
        answer: the answer's text.
    """
    return f"{FINAL_OPEN}{answer}{FINAL_CLOSE}"


def render_assistant_turn(
    calls: Sequence[ToolCall] = (), final_answer: str | None = None, *, done: bool = False
) -> str:
    """Model text for a turn (used by the reference policy and by tests).

    Args:
        calls: the tool calls, each rendered as a `<tool_call>` block.
        final_answer: a final answer after them, if any.
        done: end with `<done/>` when there is no final answer.
    """
    parts = [render_tool_call(c) for c in calls]
    if final_answer is not None:
        parts.append(render_final_answer(final_answer))
    elif done:
        parts.append("<done/>")
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------- parsing


def parse_assistant_text(text: str) -> ParsedTurn:
    """Parse one assistant message. Never raises: what cannot be parsed is in `ParsedTurn.errors`.

    Args:
        text: the model's message.
    """
    turn = ParsedTurn()
    try:
        _scan(_join_surrogate_pairs(text if isinstance(text, str) else str(text)), turn)
        _refuse_unsendable_answer(turn)
    except Exception as exc:  # a parser bug must not crash a rollout: report it as an observation
        turn.errors.append(f"could not parse the response ({type(exc).__name__}: {exc}). {FORMAT_REMINDER}")
    return turn


def sendable_text(text: str) -> str:
    """`text` as valid Unicode, ready for a gRPC string field (which must be UTF-8): surrogate pairs written
    as two code points are joined, and each lone surrogate becomes U+FFFD (the replacement character marks
    the spot in the stored text). Text without surrogates is returned as is.

    Args:
        text: any string, such as a model's output.
    """
    if _SURROGATE_RE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _join_surrogate_pairs(text: str) -> str:
    """Pairs written as two code points become one character; lone surrogates stay (and are refused later)."""
    if _SURROGATE_RE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _lone_surrogate(text: str) -> str | None:
    r"""The first lone surrogate of `text` as an escape (`\ud800`), or None: never the raw character, so a
    message quoting it stays sendable."""
    found = _SURROGATE_RE.search(text)
    return None if found is None else f"\\u{ord(found.group(0)):04x}"


def _unicode_hint(where: str, escape: str) -> str:
    return (
        f"{where} contains {escape}, a lone UTF-16 surrogate, which is not valid Unicode text: write the "
        "character itself (or both halves of a surrogate pair)"
    )


def _refuse_unsendable_answer(turn: ParsedTurn) -> None:
    """A final answer no RPC can carry does not end the episode: the model is told and may answer again."""
    escape = None if turn.final_answer is None else _lone_surrogate(turn.final_answer)
    if escape is not None:
        turn.errors.append(f"{_unicode_hint('the final answer', escape)}. {FORMAT_REMINDER}")
        turn.final_answer = None
        turn.done = False


def _scan(text: str, turn: ParsedTurn) -> None:
    pos = 0
    # A leading "</think>" without "<think>" (the chat template pre-filled the opener): skip the thoughts.
    close = text.find(THINK_CLOSE)
    if close != -1 and THINK_OPEN not in text[:close] and TOOL_CALL_OPEN not in text[:close]:
        pos = close + len(THINK_CLOSE)
    index = 0
    while True:
        match = _MARKER_RE.search(text, pos)
        if match is None:
            return
        tag = match.group(0).lower()
        if tag == THINK_OPEN:
            end = text.find(THINK_CLOSE, match.end())
            # An unclosed <think> hides nothing: the model may have run its calls into it.
            pos = match.end() if end == -1 else end + len(THINK_CLOSE)
        elif tag == TOOL_CALL_OPEN:
            index += 1
            pos = _parse_call_block(text, match.end(), index, turn)
        elif tag == FINAL_OPEN:
            end = text.find(FINAL_CLOSE, match.end())
            nxt = text.find(TOOL_CALL_OPEN, match.end())
            stop = end if end != -1 and (nxt == -1 or end < nxt) else (nxt if nxt != -1 else len(text))
            if turn.final_answer is None:
                turn.final_answer = text[match.end() : stop].strip()
            turn.done = True
            pos = stop + len(FINAL_CLOSE) if stop == end else stop
        else:  # <done/>
            turn.done = True
            pos = match.end()


def _parse_call_block(text: str, start: int, index: int, turn: ParsedTurn) -> int:
    """Parse the call after an opening tag at `start`; returns where scanning resumes."""
    body_start = _skip_fence(text, start)
    if body_start < len(text) and text[body_start] == "{":
        try:
            obj, end = _DECODER.raw_decode(text, body_start)
        except (ValueError, RecursionError):
            pass
        else:
            _accept(obj, index, turn)
            return _skip_close(text, end)
    # Broken JSON: take the block up to its closing tag (or the next marker) and repair it.
    segment_end = _block_end(text, start)
    segment = text[start:segment_end]
    obj, error = _repair(segment)
    if error is None:
        _accept(obj, index, turn)
    else:
        turn.errors.append(f"tool call #{index} is not valid JSON ({error}). {FORMAT_REMINDER}")
    if text.startswith(TOOL_CALL_CLOSE, segment_end):
        segment_end += len(TOOL_CALL_CLOSE)
    return segment_end


def _skip_fence(text: str, pos: int) -> int:
    pos = _skip_ws(text, pos)
    if text.startswith("```", pos):
        newline = text.find("\n", pos)
        pos = _skip_ws(text, newline + 1 if newline != -1 else pos + 3)
    return pos


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _skip_close(text: str, pos: int) -> int:
    after = _skip_ws(text, pos)
    if text.startswith("```", after):
        after = _skip_ws(text, after + 3)
    if text.startswith(TOOL_CALL_CLOSE, after):
        return after + len(TOOL_CALL_CLOSE)
    return pos


def _block_end(text: str, start: int) -> int:
    """End of a broken call block: its closing tag or the next marker, skipping JSON string contents."""
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "<" and (text.startswith(TOOL_CALL_CLOSE, i) or _MARKER_RE.match(text, i)):
            return i
    return len(text)


def _repair(segment: str) -> tuple[Any, str | None]:
    body = segment.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else body[3:]
    body = body.strip().removesuffix("```").strip()
    brace = body.find("{")
    if brace == -1:
        return None, "no JSON object found" if body else "empty tool call"
    body = body[brace:]
    first_error = ""
    # Cut points: the whole block, then before each line break from the end (prose after a truncated call).
    cuts = [len(body), *[i for i in range(len(body) - 1, 0, -1) if body[i] == "\n"][:_MAX_CUTS]]
    for cut in cuts:
        candidate = body[:cut].rstrip()
        for missing in range(MAX_MISSING_BRACES + 1):
            try:
                return json.loads(candidate + "}" * missing), None
            except (ValueError, RecursionError) as exc:
                if not first_error:
                    first_error = str(exc)
    return None, first_error


def _accept(obj: Any, index: int, turn: ParsedTurn) -> None:
    call, error = _normalize_call(obj)
    if call is None:
        turn.errors.append(f"tool call #{index}: {error}. {FORMAT_REMINDER}")
    else:
        turn.tool_calls.append(call)


def _normalize_call(obj: Any) -> tuple[ToolCall | None, str]:
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    if isinstance(obj.get("function"), dict) and not any(k in obj for k in _NAME_KEYS):
        obj = obj["function"]  # OpenAI style {"type": "function", "function": {"name", "arguments"}}
    name = next((obj[k] for k in _NAME_KEYS if k in obj), None)
    if not isinstance(name, str) or not name.strip():
        return None, 'missing the tool "name"'
    arguments: Any = next((obj[k] for k in _ARGUMENT_KEYS if k in obj), None)
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            return None, f'"arguments" of {name!r} is a string that is not JSON ({str(exc)[:200]})'
    error = call_error(name.strip(), arguments)
    if error is not None:
        return None, error
    return ToolCall(name=name.strip(), arguments=arguments), ""


def call_error(name: str, arguments: Any) -> str | None:
    """Why tool `name` cannot be called with `arguments`, or None when it can. The check is the client's own
    encoding (`json_text`, then UTF-8 as gRPC sends strings), so a call that parsed is never refused when
    it is sent. Messages quote the model's text with escapes only (repr), so they are sendable themselves.

    Args:
        name: the tool's name as the model wrote it.
        arguments: the parsed arguments.
    """
    escape = _lone_surrogate(name)
    if escape is not None:
        return _unicode_hint(f"the tool name {name!r}", escape)
    if not isinstance(arguments, dict):
        return f'"arguments" of {name!r} must be a JSON object, got {type(arguments).__name__}'
    # Named before json_text refuses it (which cannot say where): the model is told which string to fix.
    path = _surrogate_path(arguments, "$")
    if path is not None:
        escape = _lone_surrogate(json.dumps(arguments, ensure_ascii=False, default=str)) or r"\ud800"
        return f"arguments of {name!r}: {_unicode_hint(path, escape)}"
    try:
        json_text(arguments)
    except InvalidJsonValue as exc:
        return f"arguments of {name!r}: {exc}"
    return None


def _surrogate_path(value: Any, path: str) -> str | None:
    """Where in a JSON value the first lone surrogate is (a key or a string), for the model to fix it."""
    if isinstance(value, str):
        return f"the string at {path}" if _SURROGATE_RE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        here = f"{path}.{sendable_text(key)}" if isinstance(key, str) else f"{path}[{key}]"
        if isinstance(key, str) and _SURROGATE_RE.search(key):
            return f"the key {here}"
        found = _surrogate_path(item, here)
        if found is not None:
            return found
    return None


# --------------------------------------------------------------------------------------- tool results


_KIND_NAMES = {
    1: "unknown tool",
    2: "invalid arguments",
    3: "tool failed",
    4: "outcome unknown",
    5: "output truncated",
    6: "tool-call budget exhausted",
}


def error_kind_name(kind: int) -> str:
    """A ToolErrorKind as the model reads it in an error observation ("unknown tool", ...).

    Args:
        kind: the ToolErrorKind's number; an unknown one reads "error".
    """
    return _KIND_NAMES.get(int(kind), "error")


# A text block holding only this key is an image (Fleet's screenshot tools); its value a data URL or null.
BASE64_IMAGE_KEY = "base64_image"
SCREENSHOT_FAILED = "[screenshot failed: the tool returned no image]"


def tool_result_parts(result: Any) -> tuple[Part, ...]:
    """A rlgate ToolResult (common_pb2.ToolResult) as a model sees it: text, with each image in place.

    Content blocks are separated by a line break. An image block becomes an `ImagePart` (its bytes as the
    gateway delivered them, already bounded by its result limit); so does a text block that is exactly
    `{"base64_image": "data:image/<type>;base64,..."}`, decoded here once. `{"base64_image": null}` becomes
    a note that the screenshot failed, and a value that is not such a data URL a note saying why: never an
    exception. An error result is headed `Error (<kind>): <message>`.

    Args:
        result: the ToolResult of a CallTool.
    """
    parts: list[Part | str] = []
    for block in result.content:
        if parts:
            parts.append("\n")
        kind = block.WhichOneof("kind")
        if kind == "text":
            parts.append(_text_block(block.text.text))
        elif kind == "image":
            image = ImagePart(block.image.data, block.image.mime_type or "image/png")
            # No bytes, no image: an endpoint would refuse the empty data URL.
            parts.append(image if image.data else image.placeholder())
        elif kind == "audio":
            parts.append(f"[audio: {block.audio.mime_type or 'unknown type'}, {len(block.audio.data)} bytes]")
        elif kind == "resource_link":
            link = block.resource_link
            label = f" ({link.name})" if link.name else ""
            parts.append(f"[resource: {link.uri}{label}]")
        elif kind == "resource":
            res = block.resource
            if res.WhichOneof("contents") == "text":
                parts.append(res.text)
            else:
                parts.append(f"[resource {res.uri}: {res.mime_type or 'binary'}, {len(res.blob)} bytes]")
    if not parts and result.structured_content_json:
        parts.append(result.structured_content_json)  # the tool's JSON text, exactly
    body = Message.of("tool", parts)
    if result.is_error:
        message = result.error_message or "the tool reported an error"
        head = f"Error ({error_kind_name(result.error_kind)}): {message}"
        if not body.parts or body.text().strip() in ("", message.strip()):
            return (TextPart(head),)
        return Message.of("tool", [head, "\n", *body.parts]).parts
    if int(result.error_kind) == 5:
        return Message.of("tool", [*body.parts, "\n[output truncated]"]).parts
    return body.parts


def _text_block(text: str) -> Part:
    """A text block, or the image it carries as `{"base64_image": ...}` (a note when that is unusable)."""
    stripped = text.strip()
    # Cheap test first: most text is not this object, and parsing a large text twice is waste.
    if not (stripped.startswith("{") and stripped.endswith("}") and BASE64_IMAGE_KEY in stripped):
        return TextPart(text)
    try:
        value = json.loads(stripped)
    except (ValueError, RecursionError):
        return TextPart(text)
    if not isinstance(value, dict) or set(value) != {BASE64_IMAGE_KEY}:
        return TextPart(text)
    url = value[BASE64_IMAGE_KEY]
    if url is None:
        return TextPart(SCREENSHOT_FAILED)
    if not isinstance(url, str):
        return TextPart(f"[screenshot unreadable: base64_image is a JSON {type(url).__name__}, not a data URL]")
    try:
        return ImagePart.from_data_url(url)
    except UnreadableImage as exc:
        return TextPart(f"[screenshot unreadable: {exc}]")


def render_tool_result(result: Any) -> str:
    """The text a text-only model sees for a rlgate ToolResult: `tool_result_parts`, images as placeholders.

    Args:
        result: the ToolResult of a CallTool.
    """
    return Message.of("tool", tool_result_parts(result)).text()


def wrap_tool_response(text: str) -> str:
    """One rendered tool result in `<tool_response>` tags.

    Args:
        text: the rendered result.
    """
    return f"<tool_response>\n{text}\n</tool_response>"


def tool_response_message(results: Sequence[str | Sequence[Part]], notes: Sequence[str] = ()) -> Message:
    """One user message carrying every tool response of a turn (as Qwen's chat template renders them), each
    in `<tool_response>` tags with its images in place, then `notes` (parse errors, the format reminder),
    one a line.

    Args:
        results: each tool result as text or as parts (`tool_result_parts`), in call order.
        notes: lines for the model after the results.
    """
    pieces: list[Part | str] = []
    for result in results:
        if pieces:
            pieces.append("\n")
        pieces.append("<tool_response>\n")
        pieces.extend([result] if isinstance(result, str) else result)
        pieces.append("\n</tool_response>")
    for note in notes:
        if pieces:
            pieces.append("\n")
        pieces.append(note)
    return Message.of("user", pieces)


def error_observation(errors: Sequence[str]) -> Message:
    """A user message telling the model what was wrong with its last turn.

    Args:
        errors: one line per problem (the format reminder when empty).
    """
    return Message("user", "\n".join(errors) if errors else FORMAT_REMINDER)


def system_message(tools: Iterable[Any], instructions: str = DEFAULT_INSTRUCTIONS) -> Message:
    """The system prompt (`render_system_prompt`) as a chat message.

    Args:
        tools: rlgate ToolSpecs or mappings with `name`, `description` and `parameters`.
        instructions: text placed before the tool list.
    """
    return Message("system", render_system_prompt(tools, instructions))
