"""localfleet's web UIs (services/localfleet/webui): served under a prefix as localfleet mounts them, on a
seeded database.

HTML-level (Starlette's TestClient, real SQLite): every page reachable by links renders, every link and form is
relative to the app root, database values are escaped, bad form input comes back as a visible error (never a
500), actions post/redirect/get. In the real browser (Debian's chromium through Playwright; skipped without it,
failing under CI=true): the stored computer-use solutions still match the layout (rebuilt and compared), and
the pages fit a 1024x768 screen without horizontal scrolling.
"""

from __future__ import annotations

import html
import re
import shutil
import sqlite3
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from rlgate.localfleet.webui import APPS
from tests.localfleet.computer_tasks import TASK_FILE, build_all, launched, render, screen_page, seed_db, serve_app
from tests.support.ports import require_binary

PREFIX = "/instances/t1"
ROOT = PREFIX + "/"
ENVS = sorted(APPS)
_LINK = re.compile(r'(?:href|action|src)="([^"]*)"')
_HREF = re.compile(r'<a [^>]*href="([^"]*)"')
_ALERT = re.compile(r'role="alert">([^<]*)<')


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("webui-seeds")
    return {env: seed_db(env, root / f"{env}.db") for env in ENVS}


class App:
    """One app under PREFIX on its own copy of the seed, through a TestClient that does not follow redirects."""

    def __init__(self, env: str, db: Path) -> None:
        self.db = db
        routes = APPS[env](lambda: sqlite3.connect(db, check_same_thread=False, timeout=10))
        self.client = TestClient(Starlette(routes=[Mount(PREFIX, routes=routes)]), follow_redirects=False)

    def get(self, path: str) -> tuple[int, str]:
        r = self.client.get(ROOT + path)
        return r.status_code, r.text

    def post(self, path: str, data: dict[str, str | list[str]], *, from_page: str = "") -> str:
        """POSTs a form as the browser would from `from_page`; returns the app path it redirects to."""
        r = self.client.post(ROOT + path, data=data, headers={"referer": "http://testserver" + ROOT + from_page})
        assert r.status_code == 303, (path, r.status_code, r.text[:300])
        location = r.headers["location"]
        assert location.startswith(ROOT), location
        return location[len(ROOT) :]

    def scalar(self, sql: str, *args: object) -> object:
        conn = sqlite3.connect(self.db)
        try:
            row = conn.execute(sql, args).fetchone()
            return None if row is None else row[0]
        finally:
            conn.close()


@pytest.fixture
def app_of(seeds: dict[str, Path], tmp_path: Path) -> Iterator[object]:
    made: list[App] = []

    def make(env: str) -> App:
        db = tmp_path / f"{env}-{len(made)}.db"
        shutil.copyfile(seeds[env], db)
        made.append(App(env, db))
        return made[-1]

    yield make
    for app in made:
        app.client.close()


def notice(app: App, path: str) -> tuple[str, str]:
    """('ok' | 'error', text) shown on the page at `path` (after a redirect)."""
    status, text = app.get(path)
    assert status == 200, (path, status)
    if m := _ALERT.search(text):
        return "error", html.unescape(m.group(1))
    m = re.search(r'role="status">([^<]*)<', text)
    assert m, f"no notice on {path}"
    return "ok", html.unescape(m.group(1))


# --- every page by links: renders, relative links only ---


START = {
    "mailbox": ["", "message/428", "compose", "contacts"],
    "tracker": ["", "r/northwind/atlas-web/issues/21"],
    "booking": [
        "",
        "flights?from=SFO&to=JFK&date=2026-03-10",
        "hotels?city=Lisbon&check_in=2026-03-20&check_out=2026-03-23",
        "trips?tab=all",
        "profile",
    ],
}


@pytest.mark.parametrize("env", ENVS)
def test_pages_by_links_render_with_relative_links(env: str, app_of: object) -> None:
    app = app_of(env)  # type: ignore[operator]
    seen: set[str] = set()
    queue = list(START[env])
    while queue and len(seen) < 80:
        path = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        status, text = app.get(path)
        assert status == 200, (path, status, text[:200])
        base = f'<base href="{ROOT}">'
        assert text.count(base) == 1
        body = text.replace(base, "")
        for link in _LINK.findall(body):
            parts = urllib.parse.urlsplit(link.replace("&amp;", "&"))
            # Relative to the app root: no scheme, no host, no leading slash (it would leave the instance).
            assert not parts.scheme and not parts.netloc and not link.startswith("/"), (path, link)
        queue += [link.replace("&amp;", "&") for link in _HREF.findall(body)]
    assert len(seen) >= 15, seen


@pytest.mark.parametrize(
    ("env", "path"),
    [
        ("mailbox", "message/999999"),
        ("mailbox", "message/abc"),
        ("mailbox", "folder/Nowhere"),
        ("tracker", "r/nope/nope"),
        ("tracker", "r/northwind/docs/issues/99999"),
        ("tracker", "r/northwind/docs?state=weird"),
        ("booking", "offer/XX-1"),
        ("booking", "offer/HT-1-20200101-20200102"),
        ("booking", "trips/NOPE"),
        ("booking", "trips?tab=weird"),
        ("booking", "offer/FL-99999999999999999999"),
        ("mailbox", "no/such/page"),
        ("tracker", "r//"),
    ],
)
def test_unknown_things_are_404_pages(env: str, path: str, app_of: object) -> None:
    app = app_of(env)  # type: ignore[operator]
    status, text = app.get(path)
    assert status == 404 and "<h1>Not found</h1>" in text and '<base href="' in text


# --- escaping ---


def test_database_values_are_escaped(app_of: object) -> None:
    hostile = '<script>alert("x")</script><img src=x onerror=alert(1)>&amp;'
    escaped = "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;&amp;amp;"
    mail = app_of("mailbox")  # type: ignore[operator]
    to = mail.post("compose", {"to": "a@b.example", "subject": hostile, "body": hostile}, from_page="compose")
    status, text = mail.get(to)
    assert status == 200 and hostile not in text and text.count(escaped) >= 2
    status, text = mail.get("folder/Sent")
    assert hostile not in text and escaped in text

    tracker = app_of("tracker")  # type: ignore[operator]
    to = tracker.post("r/northwind/docs/new", {"title": hostile, "body": hostile}, from_page="r/northwind/docs/new")
    status, text = tracker.get(to)
    assert status == 200 and hostile not in text and text.count(escaped) >= 2
    issue_path = to.split("?")[0]
    to = tracker.post(issue_path + "/comment", {"op": "comment", "body": hostile}, from_page=issue_path)
    assert hostile not in tracker.get(to)[1]

    booking = app_of("booking")  # type: ignore[operator]
    conn = sqlite3.connect(booking.db)
    conn.execute("UPDATE travellers SET name = ? WHERE id = 2", (hostile,))
    conn.execute("UPDATE hotels SET name = ? WHERE city = 'Lisbon'", (hostile,))
    conn.commit()
    conn.close()
    for path in ("hotels?city=Lisbon&check_in=2026-03-20&check_out=2026-03-23", "offer/FL-100", "profile"):
        status, text = booking.get(path)
        assert status == 200 and hostile not in text and escaped in text, path
    # A search term comes back in the form, escaped.
    status, text = booking.get("flights?from=" + urllib.parse.quote('"><b>x'))
    assert status == 200 and '"><b>x' not in text and "&quot;&gt;&lt;b&gt;x" in text


# --- actions: post/redirect/get; bad input is an error notice, never a 500 ---


def test_mailbox_actions(app_of: object) -> None:
    app = app_of("mailbox")  # type: ignore[operator]
    to = app.post("message/428/flag", {"flagged": "1"}, from_page="message/428")
    assert to.startswith("message/428?") and notice(app, to) == ("ok", "Flagged")
    assert app.scalar("SELECT is_flagged FROM messages WHERE id = 428") == 1
    to = app.post("message/428/flag", {"flagged": "0", "back": "folder/Inbox?page=2"}, from_page="folder/Inbox?page=2")
    assert to.startswith("folder/Inbox?page=2&ok=")
    to = app.post("message/428/flag", {"flagged": "0", "back": "//evil.example/x"}, from_page="")
    assert to.startswith("message/428?")  # a `back` that is not an app path is ignored
    to = app.post("messages", {"ids": ["428", "417"], "op": "read"}, from_page="folder/Inbox")
    assert notice(app, to) == ("ok", "2 messages marked read")
    to = app.post("message/424/move", {"folder": "Projects"}, from_page="message/424")
    assert to.startswith("folder/Projects?") and app.scalar("SELECT folder_id FROM messages WHERE id = 424") == 7
    new_folder = app.post("folders/new", {"name": "Clients"}, from_page="folders/new")
    assert notice(app, new_folder) == ("ok", "Folder Clients created")
    reply = app.post("message/411/reply", {"body": "Sure."}, from_page="message/411/reply")
    assert notice(app, reply) == ("ok", "Reply sent")
    new_id = app.scalar("SELECT MAX(id) FROM messages")
    assert app.scalar("SELECT in_reply_to FROM messages WHERE id = ?", new_id) == 411

    before = app.scalar("SELECT COUNT(*) FROM messages")
    bad: list[tuple[str, dict[str, str | list[str]], str, str]] = [
        ("compose", {"to": "not-an-address", "subject": "x", "body": "y"}, "compose", "To: String should match"),
        ("compose", {"to": "a@b.example", "subject": "", "body": "y"}, "compose", "Subject:"),
        ("compose", {"to": "", "subject": "s", "body": "y"}, "compose", "To: List should have at least 1 item"),
        ("compose", {"to": "a@b.example", "subject": "s", "body": ""}, "compose", "Message:"),
        ("message/428/move", {"folder": "Sent"}, "message/428", "cannot be moved into Sent"),
        ("message/428/move", {"folder": "Nowhere"}, "message/428", "no folder named 'Nowhere'"),
        ("message/999999/flag", {"flagged": "1"}, "message/428", "no message with id 999999"),
        ("message/abc/read", {"read": "1"}, "message/428", "message id must be a whole number"),
        ("message/428/read", {"read": "maybe"}, "message/428", "read must be 0 or 1"),
        ("messages", {"op": "read"}, "folder/Inbox", "select at least one message"),
        ("messages", {"ids": "x", "op": "read"}, "folder/Inbox", "whole number"),
        ("messages", {"ids": "428", "op": "explode"}, "folder/Inbox", "choose an action"),
        ("messages", {"ids": "428", "op": "move", "folder": ""}, "folder/Inbox", "type the name of the folder"),
        ("folders/new", {"name": "Inbox"}, "folders/new", "already exists"),
        ("folders/new", {"name": "!!"}, "folders/new", "Folder name:"),
        ("message/428/reply", {"body": ""}, "message/428/reply", "Message:"),
    ]
    for path, data, page, message in bad:
        to = app.post(path, data, from_page=page)
        assert to.split("?")[0] == page, (path, to)
        kind, text = notice(app, to)
        assert kind == "error" and message in text, (path, text)
    assert app.scalar("SELECT COUNT(*) FROM messages") == before


def test_tracker_actions(app_of: object) -> None:
    app = app_of("tracker")  # type: ignore[operator]
    issue = "r/northwind/atlas-web/issues/32"
    assert notice(app, app.post(issue + "/assign", {"op": "assign", "assignee": "grace-larsen"}, from_page=issue)) == (
        "ok",
        "Assigned to grace-larsen",
    )
    assert notice(app, app.post(issue + "/labels", {"add": "priority: high"}, from_page=issue))[0] == "ok"
    assert notice(app, app.post(issue + "/labels", {"remove": "priority: high"}, from_page=issue))[0] == "ok"
    assert notice(app, app.post(issue + "/comment", {"op": "close_not_planned", "body": ""}, from_page=issue)) == (
        "ok",
        "Issue closed as not planned",
    )
    assert notice(app, app.post(issue + "/comment", {"op": "reopen", "body": "again"}, from_page=issue))[0] == "ok"
    made = app.post("r/northwind/docs/new", {"title": "Typo", "labels": ["bug", "question"], "assignee": "sam-rivera"})
    assert made.startswith("r/northwind/docs/issues/") and notice(app, made)[0] == "ok"

    bad: list[tuple[str, dict[str, str | list[str]], str]] = [
        (issue + "/assign", {"op": "assign", "assignee": "ghost"}, "no user with login 'ghost'"),
        (issue + "/assign", {"op": "assign", "assignee": ""}, "type the login"),
        ("r/northwind/atlas-web/issues/41/assign", {"op": "unassign"}, "is already unassigned"),
        (issue + "/assign", {"op": "??"}, "choose Assign"),
        (issue + "/labels", {"add": "urgent!!"}, "has no label 'urgent!!'"),
        (issue + "/labels", {"remove": "security"}, "does not have the label 'security'"),
        (issue + "/labels", {}, "choose a label"),
        (issue + "/comment", {"op": "comment", "body": ""}, "Comment:"),
        (issue + "/comment", {"op": "reopen"}, "is already open"),
        (issue + "/comment", {"op": "nope"}, "choose Comment"),
        ("r/northwind/atlas-web/issues/99999/comment", {"op": "comment", "body": "x"}, "has no issue #99999"),
        ("r/northwind/docs/new", {"title": "ab"}, "Title: String should have at least 3 characters"),
        ("r/northwind/docs/new", {"title": "Fine title", "labels": "nope"}, "has no label 'nope'"),
        ("r/northwind/docs/new", {"title": "Fine title", "assignee": "ghost"}, "no user with login 'ghost'"),
    ]
    before = [app.scalar(f"SELECT COUNT(*) FROM {t}") for t in ("issues", "comments", "issue_labels")]
    for path, data, message in bad:
        kind, text = notice(app, app.post(path, data, from_page=issue))
        assert kind == "error" and message in text, (path, text)
    assert [app.scalar(f"SELECT COUNT(*) FROM {t}") for t in ("issues", "comments", "issue_labels")] == before


def test_booking_actions(app_of: object) -> None:
    app = app_of("booking")  # type: ignore[operator]
    before = app.scalar("SELECT COUNT(*) FROM bookings")
    bad: list[tuple[str, dict[str, str | list[str]], str]] = [
        ("offer/FL-1", {"passengers": "9", "traveller": "1", "card": "1"}, "Passengers must be between 1 and 6"),
        ("offer/FL-1", {"passengers": "two", "traveller": "1", "card": "1"}, "Passengers must be a whole number"),
        ("offer/FL-1", {"passengers": "1"}, "choose a lead traveller and a payment card"),
        ("offer/FL-1", {"passengers": "1", "traveller": "9", "card": "1"}, "no traveller 9"),
        ("offer/FL-1", {"passengers": "1", "traveller": "1", "card": "3"}, "expired"),
        ("offer/FL-1", {"passengers": "1", "traveller": "1", "card": "1", "points": "99999999"}, "points available"),
        ("offer/XX-1", {"passengers": "1", "traveller": "1", "card": "1"}, "is not an offer id"),
        ("trips/NOPE/cancel", {}, "no booking with confirmation NOPE"),
    ]
    for path, data, message in bad:
        kind, text = notice(app, app.post(path, data, from_page="offer/FL-1"))
        assert kind == "error" and message in text, (path, text)
    assert app.scalar("SELECT COUNT(*) FROM bookings") == before
    # A booking that failed after its hold released the hold.
    assert app.scalar("SELECT COUNT(*) FROM holds WHERE status = 'active'") == 0

    to = app.post("offer/FL-1", {"passengers": "1", "traveller": "1", "card": "1", "points": "100"}, from_page="")
    kind, text = notice(app, to)
    conf = app.scalar("SELECT confirmation FROM bookings ORDER BY id DESC LIMIT 1")
    assert kind == "ok" and text == f"Booked: confirmation {conf}" and to.startswith(f"trips/{conf}?")
    status, page = app.get(f"trips/{conf}/cancel")
    assert status == 200 and "Yes, cancel booking" in page
    kind, text = notice(app, app.post(f"trips/{conf}/cancel", {}, from_page=f"trips/{conf}/cancel"))
    assert kind == "ok" and text.startswith(f"Booking {conf} cancelled")
    kind, text = notice(app, app.post(f"trips/{conf}/cancel", {}, from_page=f"trips/{conf}"))
    assert kind == "error" and "already cancelled" in text
    status, _ = app.get(f"trips/{conf}/cancel")
    assert status == 404  # nothing left to cancel
    # Search errors are shown on the search page itself.
    for path, message in [
        ("flights?from=SFO&to=ZZZ&date=2026-03-10", "unknown airport"),
        ("flights?from=SFO&to=JFK&date=2026-01-01", "must be after today"),
        ("flights?from=SFO&to=JFK&date=soon", "not a valid date"),
        ("flights?from=SFO", "fill in From, To and Date"),
        ("flights?from=SFO&to=JFK&date=2026-03-10&cabin=first", "choose a cabin"),
        ("hotels?city=Atlantis&check_in=2026-03-10&check_out=2026-03-12", "no hotels in 'Atlantis'"),
        ("hotels?city=Paris&check_in=2026-03-12&check_out=2026-03-10", "1 to 30 nights"),
    ]:
        status, text = app.get(path)
        assert status == 200 and message in html.unescape(text), (path, text[-500:])


def test_oversized_and_malformed_forms_are_errors(app_of: object) -> None:
    app = app_of("mailbox")  # type: ignore[operator]
    many = {f"f{i}": "x" for i in range(500)}
    kind, text = notice(app, app.post("compose", many, from_page="compose"))
    assert kind == "error" and "the form could not be read" in text
    huge = {"to": "a@b.example", "subject": "s", "body": "x" * 200_000}
    kind, text = notice(app, app.post("compose", huge, from_page="compose"))
    assert kind == "error" and "the form could not be read" in text
    # Multipart with a file: files are not accepted.
    r = app.client.post(ROOT + "compose", files={"f": ("a.txt", b"x")}, headers={"referer": "http://testserver" + ROOT})
    assert r.status_code == 303 and "error=" in r.headers["location"]


# --- in the real browser ---


@pytest.fixture(scope="module")
def chromium() -> str:
    return require_binary("chromium")


async def test_stored_computer_solutions_match_the_layout(chromium: str) -> None:
    """Rebuilding every computer-use solution in the browser gives the stored file (run
    `python -m tests.localfleet.computer_tasks` after a layout change)."""
    assert render(await build_all()) == TASK_FILE.read_text()


SMALL_SCREEN_PAGES = {
    "mailbox": ["", "message/428", "compose", "message/411/reply", "contacts"],
    "tracker": [
        "",
        "r/northwind/atlas-web",
        "r/northwind/atlas-web/issues/32",
        "r/northwind/atlas-web/new",
        "search?q=crash",
    ],
    "booking": [
        "flights?from=SFO&to=JFK&date=2026-03-14",
        "hotels?city=Lisbon&check_in=2026-03-20&check_out=2026-03-23",
        "offer/FL-100",
        "trips?tab=all",
        "profile",
    ],
}


@pytest.mark.parametrize("env", ENVS)
async def test_pages_fit_small_screens(env: str, chromium: str, seeds: dict[str, Path], tmp_path: Path) -> None:
    """At 1024x768 no page scrolls sideways, and every button, link button and field is at least 24 px tall."""
    db = tmp_path / "current.db"
    shutil.copyfile(seeds[env], db)
    with serve_app(env, db) as app_url:
        async with launched() as browser, screen_page(browser, 1024, 768) as page:
            for path in SMALL_SCREEN_PAGES[env]:
                response = await page.goto(app_url + path, wait_until="load")
                assert response is not None and response.status == 200, path
                width = await page.evaluate("document.documentElement.scrollWidth")
                assert width <= 1024, (path, width)
                heights = await page.eval_on_selector_all(
                    "button, .button, input[type=text], input[type=number]",
                    "els => els.map(e => e.getBoundingClientRect().height)",
                )
                assert all(h >= 24 for h in heights), (path, heights)


ODD = ["", "'", '"><', "%", "_", "\\", "0", "-1", "99999999999999999999999", "x" * 300, "2026-02-30", "é", "%00"]
PAGES = {
    "mailbox": [
        "folder/{v}",
        "message/{v}",
        "message/{v}/reply",
        "search?q={v}",
        "folder/Inbox?page={v}",
        "contacts?q={v}",
        "compose?to={v}",
    ],
    "tracker": [
        "r/{v}/{v}",
        "r/northwind/docs?state={v}",
        "r/northwind/docs?label={v}",
        "r/northwind/docs?assignee={v}",
        "r/northwind/docs/issues/{v}",
        "r/northwind/docs?page={v}",
        "search?q={v}",
        "r/{v}/docs/new",
    ],
    "booking": [
        "flights?from={v}&to=JFK&date=2026-03-10",
        "flights?from=SFO&to=JFK&date={v}",
        "flights?from=SFO&to=JFK&date=2026-03-10&sort={v}",
        "hotels?city={v}&check_in=2026-03-10&check_out=2026-03-12",
        "hotels?city=Paris&check_in=2026-03-10&check_out=2026-03-12&min_stars={v}",
        "offer/FL-{v}",
        "offer/HT-1-{v}-20260312",
        "offer/{v}",
        "trips?tab={v}",
        "trips/{v}",
        "trips/{v}/cancel",
    ],
}


@pytest.mark.parametrize("env", ENVS)
def test_odd_urls_are_pages_or_404s(env: str, app_of: object) -> None:
    """Whatever a model types into the address bar is a page or a 404 saying why, never a 500."""
    app = app_of(env)  # type: ignore[operator]
    for template in PAGES[env]:
        for value in ODD:
            path = template.format(v=urllib.parse.quote(value, safe=""))
            status, text = app.get(path)
            assert status in (200, 404) and "</html>" in text, (path, status, text[:300])
