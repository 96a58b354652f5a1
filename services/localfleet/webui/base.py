"""What every localfleet web UI shares: escaping, the page shell, flash messages, and the request plumbing.

The apps are plain server-rendered HTML (no JavaScript, no external resources) so that a model driving a
browser with mouse and keyboard (the `computer` tool) can do every task, and so that screenshots are stable:
a fixed header, sidebar and flash strip put the main content at the same place on every page.

Every path an app links to is RELATIVE to its root (`<base href>` is the mount point, computed from the ASGI
`root_path`), so an app works under any prefix (localfleet mounts it per instance).

Handlers are plain functions run in a worker thread with the instance's `current` connection:
- a page `(conn, req) -> Page` (GET); a `ToolError` becomes a 404 page saying what was not found;
- an action `(conn, req) -> Done` (POST, then a 303 redirect: post/redirect/get). A `ToolError` or a
  `BadInput` (bad form input) redirects back to the page the form was on with the message shown, never a 500.
"""

from __future__ import annotations

import html
import re
import sqlite3
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mcp.server.mcpserver.exceptions import ToolError
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

Connect = Callable[[], sqlite3.Connection]
MAX_FORM_FIELDS = 200  # a form has a few dozen fields at most (checkbox lists included)
MAX_FIELD_CHARS = 20_000  # the longest text any operation accepts (an issue body)
MAX_PART_BYTES = 64 * 1024  # one field's encoded size (20,000 characters of UTF-8 fit)


class Html(str):
    """Markup that is already safe: `h()` inserts it as is; any other value is escaped."""


def esc(value: object) -> Html:
    """`value` as HTML text (None as empty)."""
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def h(template: str, **values: object) -> Html:
    """`template.format(**values)` with every value escaped unless it is already `Html`."""
    return Html(template.format(**{k: esc(v) for k, v in values.items()}))


def join(parts: Iterable[Html]) -> Html:
    return Html("".join(parts))


def url(path: str, **query: object) -> str:
    """A relative app URL with a query string (None and "" values left out)."""
    items = {k: str(v) for k, v in query.items() if v is not None and v != ""}
    return path + ("?" + urllib.parse.urlencode(items) if items else "")


def seg(value: object) -> str:
    """One path segment, percent-encoded (folder names and labels may contain spaces or '/')."""
    return urllib.parse.quote(str(value), safe="")


_APP_PATH = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.~%+=&?/-]*$")


def back_path(value: str, default: str) -> str:
    """A relative app path a form asked to return to (`back` field), or `default` when it is not one."""
    if len(value) <= 500 and _APP_PATH.match(value) and "//" not in value and ".." not in value:
        return value
    return default


class BadInput(ValueError):
    """A form field the user filled in wrongly; the message is shown on the page."""


@dataclass(frozen=True)
class Req:
    """What a handler sees of a request: path parameters, the query and (for actions) the form."""

    path: Mapping[str, str]
    query: Mapping[str, str]
    form: Mapping[str, Sequence[str]] = field(default_factory=dict)

    def value(self, name: str, default: str = "") -> str:
        """A form field's (first) value."""
        values = self.form.get(name) or ()
        return values[0] if values else default

    def values(self, name: str) -> list[str]:
        """Every value of a form field (checkboxes)."""
        return list(self.form.get(name) or ())

    def arg(self, name: str, default: str = "") -> str:
        return self.query.get(name, default)

    def page_number(self) -> int:
        """The `page` query parameter (1-based); anything else than a small positive number is page 1."""
        raw = self.query.get("page", "1")
        return int(raw) if raw.isdigit() and 0 < int(raw) < 10_000 else 1


def checked(adapter: TypeAdapter[Any], value: object, what: str) -> Any:
    """`value` validated by the same pydantic type the MCP tool declares; BadInput naming `what` otherwise."""
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise BadInput(f"{what}: {first['msg']}") from None


def number(value: str, what: str, *, low: int = 0, high: int = 1_000_000_000) -> int:
    """An integer form field within [low, high]; BadInput otherwise."""
    text = value.strip().replace(",", "")
    if not text.lstrip("-").isdigit():
        raise BadInput(f"{what} must be a whole number")
    n = int(text)
    if not low <= n <= high:
        raise BadInput(f"{what} must be between {low} and {high}")
    return n


@dataclass(frozen=True)
class Page:
    """A rendered page: its title, main content and (optionally) what the sidebar highlights."""

    title: str
    body: Html
    active: str = ""  # what to highlight: a nav key, or "key:item" (the nav key and a sidebar item)
    status: int = 200


@dataclass(frozen=True)
class Done:
    """An action's outcome: where to go next (a relative app path) and the notice to show there."""

    to: str
    notice: str = ""


@dataclass(frozen=True)
class Shell:
    """One app's frame: its name, top navigation and sidebar, drawn around every page."""

    name: str
    user: str
    nav: Sequence[tuple[str, str, str]]  # (key, label, relative path)
    sidebar: Callable[[sqlite3.Connection, str], Html]  # (conn, active key) -> sidebar HTML
    search: tuple[str, str] | None = None  # (relative action path, placeholder) of the header's search box


CSS = """
* { box-sizing: border-box; }
html, body { margin: 0; height: 100%; }
body { font: 14px/1.4 "DejaVu Sans", "Liberation Sans", sans-serif; color: #1f2328; background: #f6f8fa; }
a { color: #0b57d0; text-decoration: none; }
a:hover { text-decoration: underline; }
header.top { position: fixed; top: 0; left: 0; right: 0; height: 56px; background: #1f3b73; color: #fff;
  display: flex; align-items: center; padding: 0 16px; gap: 8px; z-index: 2; }
header.top .brand { font-size: 18px; font-weight: bold; width: 188px; white-space: nowrap; }
header.top a.nav { color: #dbe6ff; padding: 8px 14px; border-radius: 6px; font-size: 15px; }
header.top a.nav.on { background: #2f5aa8; color: #fff; }
header.top form.search { display: flex; gap: 6px; margin-left: 16px; }
header.top form.search input { width: 280px; height: 34px; border: 0; border-radius: 6px; padding: 0 10px;
  font: inherit; }
header.top .user { margin-left: auto; color: #dbe6ff; white-space: nowrap; }
nav.side { position: fixed; top: 56px; left: 0; bottom: 0; width: 220px; background: #fff;
  border-right: 1px solid #d0d7de; padding: 12px 8px; overflow-y: auto; }
nav.side a, nav.side .head { display: flex; justify-content: space-between; height: 34px; align-items: center;
  padding: 0 12px; border-radius: 6px; color: #1f2328; white-space: nowrap; overflow: hidden; }
nav.side a.on { background: #ddeafe; font-weight: bold; }
nav.side .head { color: #57606a; font-size: 12px; text-transform: uppercase; margin-top: 8px; }
nav.side .count { color: #57606a; font-size: 12px; }
main { margin: 56px 0 0 220px; padding: 8px 24px 24px; }
.flash { height: 36px; margin-bottom: 8px; }
.flash div { height: 36px; line-height: 36px; padding: 0 12px; border-radius: 6px; overflow: hidden;
  white-space: nowrap; text-overflow: ellipsis; }
.flash .ok { background: #dafbe1; color: #116329; border: 1px solid #8ddb8c; }
.flash .error { background: #ffebe9; color: #a40e26; border: 1px solid #ff8182; }
h1 { font-size: 20px; margin: 0 0 12px; height: 28px; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
h2 { font-size: 16px; margin: 16px 0 8px; }
table.list { width: 100%; border-collapse: collapse; background: #fff; border: 1px solid #d0d7de; table-layout: fixed; }
table.list th, table.list td { height: 34px; padding: 0 8px; border-bottom: 1px solid #eaeef2; text-align: left;
  white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
table.list th { background: #f6f8fa; color: #57606a; font-weight: normal; font-size: 13px; }
table.list tr.unread td { font-weight: bold; }
.muted { color: #57606a; }
.toolbar { display: flex; gap: 8px; align-items: center; margin-bottom: 8px; height: 36px; flex-wrap: nowrap; }
button, .button { height: 32px; padding: 0 12px; border: 1px solid #afb8c1; border-radius: 6px; background: #fff;
  font: inherit; color: #1f2328; cursor: pointer; white-space: nowrap; display: inline-flex; align-items: center; }
button.primary, .button.primary { background: #1f883d; border-color: #1a7f37; color: #fff; }
button.danger { color: #cf222e; }
button.small { height: 28px; padding: 0 8px; font-size: 13px; }
button.on { background: #ddeafe; border-color: #0b57d0; }
input[type=text], input[type=number], textarea { font: inherit; border: 1px solid #afb8c1; border-radius: 6px;
  padding: 0 8px; height: 34px; background: #fff; }
textarea { padding: 8px; height: auto; resize: none; }
input[type=checkbox], input[type=radio] { width: 18px; height: 18px; margin: 0 6px 0 0; vertical-align: middle; }
form.inline { display: inline; margin: 0; }
.grid { display: grid; grid-template-columns: 160px 1fr; gap: 10px 12px; align-items: center; max-width: 760px; }
.grid label.k { color: #57606a; }
.box { background: #fff; border: 1px solid #d0d7de; border-radius: 6px; padding: 12px 16px; }
.pager { display: flex; gap: 12px; align-items: center; height: 40px; }
.chip { display: inline-block; padding: 0 8px; border-radius: 10px; font-size: 12px; line-height: 20px;
  border: 1px solid #d0d7de; margin-left: 4px; background: #f6f8fa; font-weight: normal; }
.badge { display: inline-block; padding: 0 10px; border-radius: 12px; line-height: 24px; color: #fff; font-size: 13px; }
.badge.open, .badge.confirmed { background: #1f883d; }
.badge.closed, .badge.cancelled { background: #8250df; }
pre.body { white-space: pre-wrap; font: inherit; margin: 0; }
.choices label { display: flex; align-items: center; height: 32px; }
"""


def app_root(request: Request) -> str:
    """The app's own root URL path (where it is mounted), ending with '/'."""
    return str(request.scope.get("root_path", "")).rstrip("/") + "/"


def _flash(query: Mapping[str, str]) -> Html:
    if query.get("error"):
        return h('<div class="flash"><div class="error" role="alert">{m}</div></div>', m=query["error"][:300])
    if query.get("ok"):
        return h('<div class="flash"><div class="ok" role="status">{m}</div></div>', m=query["ok"][:300])
    return Html('<div class="flash"></div>')


def render(shell: Shell, conn: sqlite3.Connection, request: Request, page: Page) -> HTMLResponse:
    """`page` inside the app's frame, as a full HTML document."""
    nav = join(
        h(
            '<a class="nav{on}" href="{href}">{label}</a>',
            on=" on" if page.active.partition(":")[0] == key else "",
            href=href,
            label=label,
        )
        for key, label, href in shell.nav
    )
    search = Html("")
    if shell.search is not None:
        action, placeholder = shell.search
        search = h(
            '<form class="search" method="get" action="{action}"><input type="text" name="q" value="{q}"'
            ' placeholder="{ph}" aria-label="Search"><button type="submit">Search</button></form>',
            action=action,
            q=request.query_params.get("q", "") if request.url.path.endswith("/" + action) else "",
            ph=placeholder,
        )
    doc = h(
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><base href="{root}">'
        "<title>{title} - {app}</title><style>{css}</style></head><body>"
        '<header class="top"><span class="brand">{app}</span>{nav}{search}<span class="user">{user}</span></header>'
        '<nav class="side">{side}</nav><main>{flash}{body}</main></body></html>',
        root=app_root(request),
        title=page.title,
        app=shell.name,
        css=Html(CSS),
        nav=nav,
        search=search,
        user=shell.user,
        side=shell.sidebar(conn, page.active),
        flash=_flash(request.query_params),
        body=page.body,
    )
    return HTMLResponse(doc, status_code=page.status)


def _back(request: Request) -> str:
    """The app path (with query, minus old notices) the form was posted from, per its Referer; else the root."""
    referer = request.headers.get("referer", "")
    parts = urllib.parse.urlsplit(referer)
    root = app_root(request)
    same_site = parts.netloc in ("", request.headers.get("host", ""))
    if not referer or not same_site or not parts.path.startswith(root):
        return ""
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k not in ("ok", "error")]
    return parts.path[len(root) :] + ("?" + urllib.parse.urlencode(query) if query else "")


def redirect(request: Request, to: str, **notice: str) -> RedirectResponse:
    """303 to the app path `to` (relative to the app root), with a notice (`ok=` or `error=`)."""
    base, _, query = to.partition("?")
    pairs = urllib.parse.parse_qsl(query) + [(k, v) for k, v in notice.items() if v]
    target = app_root(request) + base.lstrip("/") + ("?" + urllib.parse.urlencode(pairs) if pairs else "")
    return RedirectResponse(target, status_code=303)


def _error_message(exc: Exception) -> str:
    return str(exc).strip() or type(exc).__name__


def routes(
    shell: Shell,
    connect: Connect,
    pages: Sequence[tuple[str, Callable[[sqlite3.Connection, Req], Page | Done]]],
    actions: Sequence[tuple[str, Callable[[sqlite3.Connection, Req], Done]]],
) -> list[BaseRoute]:
    """Starlette routes for an app's pages (GET) and actions (POST), each run in a worker thread with its own
    connection to the instance's `current` database (closed when the handler returns)."""

    def with_conn(fn: Callable[[sqlite3.Connection], Response]) -> Response:
        conn = connect()
        try:
            return fn(conn)
        finally:
            conn.close()

    def page_endpoint(handler: Callable[[sqlite3.Connection, Req], Page | Done]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            req = Req(path=dict(request.path_params), query=dict(request.query_params))

            def run(conn: sqlite3.Connection) -> Response:
                try:
                    out = handler(conn, req)
                except (ToolError, BadInput) as exc:
                    body = h('<h1>Not found</h1><p class="box">{m}</p>', m=_error_message(exc))
                    out = Page("Not found", body, status=404)
                if isinstance(out, Done):
                    return redirect(request, out.to, ok=out.notice)
                return render(shell, conn, request, out)

            return await run_in_threadpool(with_conn, run)

        return endpoint

    def action_endpoint(handler: Callable[[sqlite3.Connection, Req], Done]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                async with request.form(max_files=0, max_fields=MAX_FORM_FIELDS, max_part_size=MAX_PART_BYTES) as form:
                    fields: dict[str, list[str]] = {}
                    for key, value in form.multi_items():
                        if isinstance(value, str):
                            fields.setdefault(key, []).append(value[:MAX_FIELD_CHARS])
            except (HTTPException, MultiPartException) as exc:  # too many or too large fields: shown, never a 500
                detail = exc.detail if isinstance(exc, HTTPException) else exc.message
                return redirect(request, _back(request), error=f"the form could not be read: {detail}")
            req = Req(path=dict(request.path_params), query=dict(request.query_params), form=fields)

            def run(conn: sqlite3.Connection) -> Response:
                try:
                    done = handler(conn, req)
                except (ToolError, BadInput) as exc:
                    return redirect(request, _back(request), error=_error_message(exc))
                return redirect(request, done.to, ok=done.notice)

            return await run_in_threadpool(with_conn, run)

        return endpoint

    def unknown(conn: sqlite3.Connection, req: Req) -> Page:
        raise BadInput(f"this app has no page '{req.path['rest'][:200]}'")

    out: list[BaseRoute] = [Route(path, page_endpoint(fn), methods=["GET"]) for path, fn in pages]
    out += [Route(path, action_endpoint(fn), methods=["POST"]) for path, fn in actions]
    out.append(Route("/{rest:path}", page_endpoint(unknown), methods=["GET"]))  # any other page: the app's 404
    return out


def pager(req: Req, path: str, total: int, per_page: int, **query: object) -> Html:
    """'1-15 of 123' with Newer/Older links keeping the other query parameters."""
    page = req.page_number()
    first = (page - 1) * per_page
    shown = f"{min(first + 1, total)}-{min(first + per_page, total)} of {total}" if total else "none"
    prev = (
        h('<a class="button" href="{href}">&lsaquo; Prev</a>', href=url(path, **query, page=page - 1))
        if page > 1
        else Html('<span class="button muted">&lsaquo; Prev</span>')
    )
    nxt = (
        h('<a class="button" href="{href}">Next &rsaquo;</a>', href=url(path, **query, page=page + 1))
        if first + per_page < total
        else Html('<span class="button muted">Next &rsaquo;</span>')
    )
    return h('<div class="pager">{prev}{nxt}<span class="muted">{shown}</span></div>', prev=prev, nxt=nxt, shown=shown)
