"""A real OpenAI-compatible chat endpoint for tests: an aiohttp server on 127.0.0.1 (port 0) in its own thread,
answering `POST /v1/chat/completions` with `reply(request_body)` as the assistant's text and recording every
request body."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web


class OpenAIStub:
    """Use as a context manager; `base_url` is what `--base-url` takes, `requests` the bodies received."""

    def __init__(self, reply: Callable[[dict[str, Any]], str]) -> None:
        self.reply = reply
        self.requests: list[dict[str, Any]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        text = self.reply(body)
        return web.json_response(
            {"id": "stub", "object": "chat.completion", "model": body.get("model", ""),
             "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]}
        )  # fmt: skip

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def __enter__(self) -> OpenAIStub:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def turn_of(body: dict[str, Any]) -> int:
    """The turn a request asks for: the assistant messages already in it."""
    return sum(m.get("role") == "assistant" for m in body["messages"])


def image_urls(body: dict[str, Any]) -> list[str]:
    """Every `image_url` URL of a request, in order."""
    return [
        part["image_url"]["url"]
        for m in body["messages"]
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image_url"
    ]
