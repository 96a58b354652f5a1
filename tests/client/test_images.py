"""Images reach the model: tool results render to typed parts (rlgate.protocol), screens beyond the last few
leave the context (rlgate.messages.keep_last_images), and nothing an upstream sends as an image (malformed
base64, a null screenshot, bytes that are no image) raises."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from rlgate import protocol
from rlgate.messages import (
    IMAGE_OMITTED,
    ImagePart,
    Message,
    TextPart,
    UnreadableImage,
    images_to_omit,
    keep_last_images,
    to_openai,
)
from rlgate.v1 import common_pb2
from tests.client.images import base64_image_block, data_url, image_block, jpeg, png, size_of, text_block

PNG = png(64, 48)


def _result(*blocks: common_pb2.ContentBlock, **fields: object) -> common_pb2.ToolResult:
    return common_pb2.ToolResult(content=list(blocks), **fields)  # type: ignore[arg-type]


def test_an_image_block_is_an_image_part_in_place() -> None:
    parts = protocol.tool_result_parts(_result(text_block("before"), image_block(PNG), text_block("after")))
    assert parts == (TextPart("before\n"), ImagePart(PNG, "image/png"), TextPart("\nafter"))
    assert protocol.render_tool_result(_result(image_block(PNG))) == f"[image: image/png, {len(PNG)} bytes]"
    assert protocol.tool_result_parts(_result(image_block(b""))) == (TextPart("[image: image/png, 0 bytes]"),)


def test_a_base64_image_text_block_is_an_image_part_decoded() -> None:
    picture = jpeg(40, 30)
    (part,) = protocol.tool_result_parts(_result(base64_image_block(data_url(picture, "image/jpeg"))))
    assert part == ImagePart(picture, "image/jpeg") and size_of(part.data) == (40, 30)
    spaced = text_block(f'  {{"base64_image" : "{data_url(PNG)}"}}\n')
    assert protocol.tool_result_parts(_result(spaced)) == (ImagePart(PNG, "image/png"),)


def test_a_null_screenshot_is_a_note() -> None:
    assert protocol.tool_result_parts(_result(base64_image_block(None))) == (TextPart(protocol.SCREENSHOT_FAILED),)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("data:image/png;base64,@@not base64@@", "malformed base64"),
        ("data:image/png;base64,", "carries no bytes"),
        ("iVBORw0KGgo=", "not a data:image/...;base64 URL"),  # raw base64, no data URL
        ("data:text/plain;base64,aGk=", "not a data:image/...;base64 URL"),
        ("https://example.invalid/shot.png", "not a data:image/...;base64 URL"),
        (17, "a JSON int, not a data URL"),
    ],
)
def test_an_unusable_base64_image_is_a_note_not_an_exception(value: object, why: str) -> None:
    block = text_block(json.dumps({"base64_image": value}))
    (part,) = protocol.tool_result_parts(_result(block))
    assert isinstance(part, TextPart) and part.text.startswith("[screenshot unreadable: ") and why in part.text


@pytest.mark.parametrize(
    "text",
    [
        f'{{"base64_image": "{data_url(PNG)}", "width": 64}}',  # not exactly the one key: the tool's text
        '{"base64_image": "data:image/png;base64,AAAA"',  # not JSON
        '["base64_image"]',
        "the base64_image tool is down",
    ],
)
def test_other_text_mentioning_base64_image_stays_text(text: str) -> None:
    assert protocol.tool_result_parts(_result(text_block(text))) == (TextPart(text),)


def test_an_error_result_keeps_its_image_after_the_head() -> None:
    result = _result(
        text_block("the click missed"),
        image_block(PNG),
        is_error=True,
        error_kind=common_pb2.TOOL_ERROR_KIND_TOOL_FAILED,
        error_message="the click missed",
    )
    parts = protocol.tool_result_parts(result)
    assert parts == (TextPart("Error (tool failed): the click missed\nthe click missed\n"), ImagePart(PNG, "image/png"))
    truncated = _result(image_block(PNG), error_kind=common_pb2.TOOL_ERROR_KIND_OUTPUT_TRUNCATED)
    assert protocol.tool_result_parts(truncated)[-1] == TextPart("\n[output truncated]")


def test_tool_response_message_keeps_images_in_place() -> None:
    shot = protocol.tool_result_parts(_result(text_block("screen:"), image_block(PNG)))
    message = protocol.tool_response_message(["ok", shot], notes=["tool call #2 is not valid JSON"])
    assert message.role == "user" and message.images == (ImagePart(PNG, "image/png"),)
    openai = message.to_openai()["content"]
    assert [p["type"] for p in openai] == ["text", "image_url", "text"]
    assert openai[0]["text"] == "<tool_response>\nok\n</tool_response>\n<tool_response>\nscreen:\n"
    assert openai[1]["image_url"]["url"] == data_url(PNG)
    assert openai[2]["text"] == "\n</tool_response>\ntool call #2 is not valid JSON"
    assert f"screen:\n[image: image/png, {len(PNG)} bytes]\n</tool_response>" in message.text()
    assert protocol.error_observation([]) == Message("user", protocol.FORMAT_REMINDER)
    assert protocol.system_message([]).role == "system"


def test_image_part_decoding() -> None:
    assert ImagePart.from_data_url(data_url(PNG)) == ImagePart(PNG, "image/png")
    assert ImagePart(PNG, "image/png").to_pil().size == (64, 48)
    for broken in (b"not an image", PNG[: len(PNG) // 2]):
        with pytest.raises(UnreadableImage):
            ImagePart(broken, "image/png").to_pil()
    out = io.BytesIO()
    Image.new("1", (8000, 5000)).save(out, format="PNG")  # a few kilobytes that decode to 40 million pixels
    bomb = out.getvalue()
    assert len(bomb) < 200_000
    with pytest.raises(UnreadableImage, match="8000x5000 pixels is larger than 8K"):
        ImagePart(bomb, "image/png").to_pil()


def _turn(i: int) -> list[Message]:
    shot = protocol.tool_result_parts(_result(text_block(f"turn {i}"), image_block(png(64, 48, (i, i, i)))))
    return [Message("assistant", f"click {i}"), protocol.tool_response_message([shot])]


def test_keep_last_images_keeps_the_last_n_and_notes_the_rest() -> None:
    chat = [Message("system", "tools"), Message("user", "task")]
    for i in range(5):
        chat += _turn(i)
    kept = keep_last_images(chat, 3)
    assert [len(m.images) for m in kept] == [0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1]
    assert kept[-1].images == chat[-1].images and kept[7].images == chat[7].images
    assert IMAGE_OMITTED in kept[3].text() and kept[3].images == ()
    assert kept[0] is chat[0] and kept[-1] is chat[-1]  # untouched messages are the same objects
    assert all(m.images == () for m in keep_last_images(chat, 0))
    assert keep_last_images(chat, 100) == chat
    with pytest.raises(ValueError, match="0 or more"):
        keep_last_images(chat, -1)
    assert images_to_omit([2, 0, 3, 1], 2) == [2, 0, 2, 0]


def test_a_fifty_turn_conversation_stays_bounded() -> None:
    """Applied each turn (as rollout and the adapters do), the prompt of turn 50 is as big as that of turn 3
    give or take its text: three screens, never fifty."""
    chat = [Message("system", "tools"), Message("user", "task")]
    sizes = []
    for i in range(50):
        chat = keep_last_images([*chat, *_turn(i)], 3)
        sizes.append(len(json.dumps(to_openai(chat))))
    assert sum(len(m.images) for m in chat) == 3
    text_growth = sizes[-1] - sizes[2]
    per_turn_text = 300  # the notes, "click i" and the tags of one turn: text, not screens
    assert text_growth < 47 * per_turn_text, sizes
    assert sizes[-1] < 4 * len(data_url(png(64, 48))) + 50 * per_turn_text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: data_url(b))))
def test_no_base64_image_value_raises(value: str) -> None:
    for block in (base64_image_block(value), text_block(value)):
        parts = protocol.tool_result_parts(_result(block))
        Message.of("user", parts).text()
        for part in parts:
            if isinstance(part, ImagePart):
                with contextlib.suppress(UnreadableImage):
                    part.to_pil()
