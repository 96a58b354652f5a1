"""localfleet's computer-use tasks (services/localfleet/tasks/computer_use.json): written here, built there.

Each task is a prompt, a verifier over the database (seed vs current, like the tool_use tasks) and the steps of
a reference solution named by what they act on (a CSS selector to click, text to type, a key, a page to open).
Building renders each step in the real browser at the screen size of localfleet's screens (1280x800), turns
it into the `computer` action a model would send (`left_click` at the element's centre, `type`, `key`,
`navigate`), checks that the point hits that element, and checks that the finished solution scores 1.0. The
file stores only the actions, so replaying it exercises exactly what a model's clicks would.

    .venv/bin/python -m tests.localfleet.computer_tasks        # rewrites computer_use.json

`tests/localfleet/test_webui.py` rebuilds the file in memory and fails when it differs (a layout change that
moved an element), and `tests/localfleet/test_tasks.py` replays every stored solution through a real
localfleet's `computer` tool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import sqlite3
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fleet.verifiers.local_executor import execute_verifier_local
from playwright.async_api import Browser, Page, async_playwright
from starlette.applications import Starlette
from starlette.routing import Mount

from rlgate.localfleet.browser import INSTALL_HINT, LAUNCH_ARGS, Screen, find_executable
from rlgate.localfleet.computer import parse_keys
from rlgate.localfleet.environments import get_environment
from rlgate.localfleet.tasks_loader import TASKS_DIR
from rlgate.localfleet.webui import APPS

TASK_FILE = TASKS_DIR / "computer_use.json"
WIDTH, HEIGHT = 1280, 800  # localfleet's default screen (--browser-viewport)
PREFIX = "/instances/build"  # where the app is mounted while building (any prefix gives the same layout)


@dataclass(frozen=True)
class Click:
    selector: str  # exactly one visible element


@dataclass(frozen=True)
class Type:
    text: str


@dataclass(frozen=True)
class Key:
    keys: str  # as the computer tool takes them: 'Enter', 'ctrl+a'


@dataclass(frozen=True)
class Navigate:
    url: str  # relative to the page the browser shows (the app's own URL at the start)


Step = Click | Type | Key | Navigate


@dataclass(frozen=True)
class ComputerTask:
    key: str
    env_id: str
    prompt: str
    doc: str  # the verifier's docstring: what it checks
    check: str  # the verifier's body after the shared helpers (returns a score)
    steps: Sequence[Step]


# The helpers every verifier starts with (as the tool_use tasks' verifiers do): rows by id, rows changed or
# added between seed and current.
_HELPERS = '''    env.instance.load()
    seed = env.db("seed")
    cur = env.db("current")

    def by_id(db, table):
        return {r["id"]: r for r in db.table(table).all()}

    def changed(table, ignore=()):
        """ids of rows added, removed or modified (ignoring some columns) between seed and current."""
        a, b = by_id(seed, table), by_id(cur, table)
        out = set(a) ^ set(b)
        for k in set(a) & set(b):
            if any(a[k][c] != b[k][c] for c in a[k] if c not in ignore):
                out.add(k)
        return out

    def added(table):
        """rows present in current but not in seed."""
        a, b = by_id(seed, table), by_id(cur, table)
        return [b[k] for k in sorted(set(b) - set(a))]

'''


def verifier_code(task: ComputerTask) -> str:
    body = "\n".join(("    " + line if line else "") for line in task.check.strip("\n").splitlines())
    return f'def verify(env, final_answer=None):\n    """{task.doc}"""\n{_HELPERS}{body}\n'


def _msg(i: int) -> str:
    return f'a[href="message/{i}"]'


_MAIL_FOLDERS = """
folders = {f["name"]: f["id"] for f in seed.table("folders").all()}
"""

_TRACKER = """
repos = {r["full_name"]: r["id"] for r in seed.table("repos").all()}
users = {u["login"]: u["id"] for u in seed.table("users").all()}
label_names = {l["id"]: l["name"] for l in cur.table("labels").all()}

def issue(db, repo, number):
    return db.table("issues").eq("repo_id", repos[repo]).eq("number", number).first()

def labels_of(db, issue_id):
    return {label_names[r["label_id"]] for r in db.table("issue_labels").eq("issue_id", issue_id).all()}

def pairs(db):
    return {(r["issue_id"], r["label_id"]) for r in db.table("issue_labels").all()}
"""

_BOOKING = """
travellers = {t["name"]: t["id"] for t in seed.table("travellers").all()}
cards = {c["brand"]: c["id"] for c in seed.table("payment_methods").all()}

def untouched_except(bookings, flights, hotels):
    return (changed("bookings") == set(bookings) and changed("flights") == set(flights)
            and changed("hotels") == set(hotels) and changed("travellers") == set()
            and changed("payment_methods") == set())

def one_new_booking():
    new = added("bookings")
    if len(new) != 1:
        print(f"expected one new booking, found {len(new)}")
        return None
    return new[0]
"""

TASKS: tuple[ComputerTask, ...] = (
    # --- mailbox ---------------------------------------------------------------------------------------------
    ComputerTask(
        key="mailbox-cu-flag-offsite",
        env_id="mailbox",
        prompt="Open the newest 'Offsite agenda' email in my Inbox (from Olivia Brown), flag it for follow-up "
        "and mark it as read.",
        doc="Message 428 (Olivia Brown, Offsite agenda) is flagged and read; no other message changed.",
        check="""
m = by_id(cur, "messages")[428]
if (m["is_flagged"], m["is_read"]) != (1, 1):
    print(f"flagged={m['is_flagged']} read={m['is_read']}")
    return TASK_FAILED_SCORE
if changed("messages") != {428} or changed("messages", ignore=("is_flagged", "is_read")):
    print("other messages changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(Click(_msg(428)), Click('form[action="message/428/flag"] button'), Click('button:text("Mark read")')),
    ),
    ComputerTask(
        key="mailbox-cu-interview-to-projects",
        env_id="mailbox",
        prompt="Move the 'Interview feedback' email from Priya Morgan in my Inbox to the Projects folder.",
        doc="Message 424 (Priya Morgan, Interview feedback) is in Projects; no other message changed.",
        check=_MAIL_FOLDERS
        + """
if by_id(cur, "messages")[424]["folder_id"] != folders["Projects"]:
    print("the message is not in Projects")
    return TASK_FAILED_SCORE
if changed("messages") != {424} or changed("messages", ignore=("folder_id",)) or changed("folders"):
    print("other messages or folders changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(Click(_msg(424)), Click('button[name="folder"][value="Projects"]')),
    ),
    ComputerTask(
        key="mailbox-cu-reply-contract",
        env_id="mailbox",
        prompt="Reply to Chloe Lee's email 'Contract renewal with Tailspin Toys' in my Inbox with: "
        "Yes, let's renegotiate the support tier.",
        doc="One reply to message 411 in Sent, to Chloe Lee only, saying to renegotiate; nothing else changed.",
        check=_MAIL_FOLDERS
        + """
new = added("messages")
if len(new) != 1:
    print(f"expected one new message, found {len(new)}")
    return TASK_FAILED_SCORE
r = new[0]
if (r["folder_id"], r["in_reply_to"], r["to_addrs"]) != (folders["Sent"], 411, "chloe.lee@northwind.example"):
    print(f"not a reply to 411 in Sent to Chloe: {r['folder_id']}, {r['in_reply_to']}, {r['to_addrs']}")
    return TASK_FAILED_SCORE
if "renegotiate" not in r["body"].lower() or not r["subject"].lower().startswith("re:"):
    print(f"wrong subject or body: {r['subject']!r} {r['body']!r}")
    return TASK_FAILED_SCORE
if changed("messages") != {r["id"]}:
    print("other messages changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(
            Click(_msg(411)),
            Click('a:text-is("Reply")'),
            Click("textarea#body"),
            Type("Yes, let's renegotiate the support tier."),
            Click('button:text("Send")'),
        ),
    ),
    ComputerTask(
        key="mailbox-cu-compose-tomas",
        env_id="mailbox",
        prompt="Send an email to Tomás García (tomas.garcia@wideworld.example) with the subject 'Offsite dates' "
        "asking him to confirm the offsite dates by Friday.",
        doc="One new message in Sent to tomas.garcia@wideworld.example, subject 'Offsite dates', mentioning "
        "Friday; nothing else changed.",
        check=_MAIL_FOLDERS
        + """
new = added("messages")
if len(new) != 1:
    print(f"expected one new message, found {len(new)}")
    return TASK_FAILED_SCORE
m = new[0]
subject = re.sub(r"[^a-z]", "", m["subject"].lower())
if m["folder_id"] != folders["Sent"] or m["to_addrs"].lower() != "tomas.garcia@wideworld.example":
    print(f"wrong folder or recipients: {m['to_addrs']!r}")
    return TASK_FAILED_SCORE
if subject != "offsitedates" or "friday" not in m["body"].lower():
    print(f"wrong subject or body: {m['subject']!r} {m['body']!r}")
    return TASK_FAILED_SCORE
if changed("messages") != {m["id"]}:
    print("other messages changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(
            Click('a:text("Compose")'),
            Click("input#to"),
            Type("tomas.garcia@wideworld.example"),
            Click("input#subject"),
            Type("Offsite dates"),
            Click("textarea#body"),
            Type("Hi Tomás, could you confirm the offsite dates by Friday? Thanks, Alex"),
            Click('button:text("Send")'),
        ),
    ),
    ComputerTask(
        key="mailbox-cu-read-newest-unread",
        env_id="mailbox",
        prompt="Mark the three newest unread emails in my Inbox as read, without opening them one by one "
        "(select them in the list).",
        doc="Messages 428, 417 and 406 (the newest unread Inbox messages) are read; no other message changed.",
        check="""
now = by_id(cur, "messages")
if any(now[i]["is_read"] != 1 for i in (428, 417, 406)):
    print("some of the three are still unread")
    return TASK_FAILED_SCORE
if changed("messages") != {428, 417, 406} or changed("messages", ignore=("is_read",)):
    print("other messages changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(
            Click('input[name="ids"][value="428"]'),
            Click('input[name="ids"][value="417"]'),
            Click('input[name="ids"][value="406"]'),
            Click('button[value="read"]'),
        ),
    ),
    ComputerTask(
        key="mailbox-cu-archive-contoso-renewal",
        env_id="mailbox",
        prompt="Victor Petrov's email about the contract renewal with Contoso (in my Inbox, from mid-February) is "
        "handled. Archive it.",
        doc="Message 361 (Victor Petrov, Contract renewal with Contoso) is in Archive; no other message changed.",
        check=_MAIL_FOLDERS
        + """
if by_id(cur, "messages")[361]["folder_id"] != folders["Archive"]:
    print("the message is not in Archive")
    return TASK_FAILED_SCORE
if changed("messages") != {361} or changed("messages", ignore=("folder_id",)) or changed("folders"):
    print("other messages or folders changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(Click('a.button:text("Next")'), Click(_msg(361)), Click('button[name="folder"][value="Archive"]')),
    ),
    # --- tracker ---------------------------------------------------------------------------------------------
    ComputerTask(
        key="tracker-cu-comment",
        env_id="tracker",
        prompt="On northwind/atlas-web#41 ('Crash when exporting with an empty workspace'), leave the comment: "
        "Reproduced on main with an empty workspace.",
        doc="One new comment by sam-rivera on atlas-web#41 saying it was reproduced; no issue changed otherwise.",
        check=_TRACKER
        + """
target = issue(cur, "northwind/atlas-web", 41)
new = added("comments")
if len(new) != 1 or new[0]["issue_id"] != target["id"] or new[0]["author_id"] != users["sam-rivera"]:
    print(f"expected one comment by sam-rivera on the issue, found {new}")
    return TASK_FAILED_SCORE
if "reproduced" not in new[0]["body"].lower():
    print(f"comment {new[0]['body']!r}")
    return TASK_FAILED_SCORE
if changed("issues", ignore=("updated_at",)) or changed("issues") - {target["id"]} or pairs(cur) != pairs(seed):
    print("issues or labels changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(
            Navigate("r/northwind/atlas-web/issues/41"),
            Click('textarea[name="body"]'),
            Type("Reproduced on main with an empty workspace."),
            Click('button[value="comment"]'),
        ),
    ),
    ComputerTask(
        key="tracker-cu-close-answered-question",
        env_id="tracker",
        prompt="The question in northwind/atlas-web 'How do I configure pagination cursors?' is answered in the "
        "docs. Find it (search for it) and close it as not planned.",
        doc="atlas-web#21 is closed as not planned; nothing else changed.",
        check=_TRACKER
        + """
target = issue(cur, "northwind/atlas-web", 21)
if (target["state"], target["state_reason"]) != ("closed", "not_planned"):
    print(f"issue is {target['state']} / {target['state_reason']}")
    return TASK_FAILED_SCORE
if changed("issues") != {target["id"]} or changed("comments") or pairs(cur) != pairs(seed):
    print("other issues, comments or labels changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(
            Click('header input[name="q"]'),
            Type("pagination cursors"),
            Key("Enter"),
            Click('a[href="r/northwind/atlas-web/issues/21"]'),
            Click('button[value="close_not_planned"]'),
        ),
    ),
    ComputerTask(
        key="tracker-cu-assign-and-prioritize",
        env_id="tracker",
        prompt="Assign northwind/atlas-web#32 to grace-larsen and add the 'priority: high' label to it.",
        doc="atlas-web#32 is assigned to grace-larsen and has 'priority: high' besides its old labels; nothing "
        "else changed.",
        check=_TRACKER
        + """
target = issue(cur, "northwind/atlas-web", 32)
if target["assignee_id"] != users["grace-larsen"]:
    print("not assigned to grace-larsen")
    return TASK_FAILED_SCORE
if labels_of(cur, target["id"]) != labels_of(seed, target["id"]) | {"priority: high"}:
    print(f"labels {labels_of(cur, target['id'])}")
    return TASK_FAILED_SCORE
if changed("issues") != {target["id"]} or {p[0] for p in pairs(cur) ^ pairs(seed)} != {target["id"]}:
    print("other issues changed")
    return TASK_FAILED_SCORE
if changed("comments"):
    print("comments changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(
            Navigate("r/northwind/atlas-web"),
            Click('a[href="r/northwind/atlas-web/issues/32"]'),
            Click('input[name="assignee"]'),
            Type("grace-larsen"),
            Click('button[value="assign"]'),
            Click('button[value="priority: high"]'),
        ),
    ),
    ComputerTask(
        key="tracker-cu-new-bug",
        env_id="tracker",
        prompt="Open a new issue in northwind/cobalt-cli titled 'Deploy command ignores the --region flag', "
        "labelled 'bug' and assigned to yourself.",
        doc="One new open cobalt-cli issue with that title, label bug only, assigned to and opened by sam-rivera.",
        check=_TRACKER
        + """
new = added("issues")
if len(new) != 1:
    print(f"expected one new issue, found {len(new)}")
    return TASK_FAILED_SCORE
i = new[0]
title = re.sub(r"[^a-z0-9]", "", i["title"].lower())
if i["repo_id"] != repos["northwind/cobalt-cli"] or title != "deploycommandignorestheregionflag":
    print(f"wrong repo or title: {i['title']!r}")
    return TASK_FAILED_SCORE
if (i["assignee_id"], i["author_id"], i["state"]) != (users["sam-rivera"], users["sam-rivera"], "open"):
    print("wrong assignee, author or state")
    return TASK_FAILED_SCORE
if labels_of(cur, i["id"]) != {"bug"}:
    print(f"labels {labels_of(cur, i['id'])}")
    return TASK_FAILED_SCORE
if changed("issues") != {i["id"]} or {p[0] for p in pairs(cur) ^ pairs(seed)} != {i["id"]}:
    print("other issues changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(
            Click('nav.side a[href="r/northwind/cobalt-cli"]'),
            Click('a:text("New issue")'),
            Click("input#title"),
            Type("Deploy command ignores the --region flag"),
            Click('input[name="labels"][value="bug"]'),
            Click("input#assignee"),
            Type("sam-rivera"),
            Click('button:text("Submit new issue")'),
        ),
    ),
    # --- booking ---------------------------------------------------------------------------------------------
    ComputerTask(
        key="booking-cu-cancel-paris-hotel",
        env_id="booking",
        prompt="My Paris trip is off. Cancel my upcoming hotel booking in Paris.",
        doc="The upcoming Paris hotel booking is cancelled (refunded, its room released); nothing else changed.",
        check=_BOOKING
        + """
paris = [b for b in seed.table("bookings").eq("status", "confirmed").eq("kind", "hotel").all()
         if b["check_in"] > "2026-03-02"
         and seed.table("hotels").eq("id", b["hotel_id"]).first()["city"] == "Paris"]
target = by_id(cur, "bookings")[paris[0]["id"]]
if target["status"] != "cancelled" or target["refund_cents"] != target["charged_cents"]:
    print(f"booking is {target['status']}, refund {target['refund_cents']}")
    return TASK_FAILED_SCORE
if added("bookings") or not untouched_except([target["id"]], [], [target["hotel_id"]]):
    print("other bookings, flights or hotels changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(
            Click('header a:text("My trips")'),
            Click('tr:has-text("Paris") a:text("View")'),
            Click('a:text("Cancel booking")'),
            Click('button:text("Yes, cancel booking")'),
        ),
    ),
    ComputerTask(
        key="booking-cu-sfo-jfk-economy",
        env_id="booking",
        prompt="Book me (Jamie Park) on the cheapest economy flight from SFO to JFK on 2026-03-14 that still has "
        "a seat, paying with my default card.",
        doc="One new booking: the cheapest economy SFO-JFK fare on 2026-03-14 with seats, 1 passenger, Jamie "
        "Park, Visa, no points; its seat taken; nothing else changed.",
        check=_BOOKING
        + """
fares = [f for f in seed.table("flights").eq("origin", "SFO").eq("destination", "JFK").eq("cabin", "economy").all()
         if f["depart_at"].startswith("2026-03-14") and f["seats_left"] > 0]
best = min(fares, key=lambda f: (f["price_cents"], f["id"]))
b = one_new_booking()
if b is None:
    return TASK_FAILED_SCORE
want = ("flight", best["id"], 1, travellers["Jamie Park"], cards["Visa"], 0, best["price_cents"], "confirmed")
got = (b["kind"], b["flight_id"], b["passengers"], b["traveller_id"], b["payment_method_id"], b["points_redeemed"],
       b["total_cents"], b["status"])
if got != want:
    print(f"booking {got} != expected {want}")
    return TASK_FAILED_SCORE
if not untouched_except([b["id"]], [best["id"]], []):
    print("other bookings, flights or hotels changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(
            Click('input[name="from"]'),
            Type("SFO"),
            Click('input[name="to"]'),
            Type("JFK"),
            Click('input[name="date"]'),
            Type("2026-03-14"),
            Click('input[name="cabin"][value="economy"]'),
            Click('button:text("Search flights")'),
            Click('table.list a:text("Select") >> nth=0'),
            Click('button:text("Book now")'),
        ),
    ),
    ComputerTask(
        key="booking-cu-lisbon-hotel-mastercard",
        env_id="booking",
        prompt="Book the cheapest hotel in Lisbon with at least 4 stars that still has rooms, from 2026-03-27 to "
        "2026-03-29, for Robin Park (one guest), paying with the Mastercard.",
        doc="One new booking: the cheapest 4+ star Lisbon hotel with rooms, 2026-03-27..29, Robin Park, "
        "Mastercard; one room taken; nothing else changed.",
        check=_BOOKING
        + """
fits = [h for h in seed.table("hotels").eq("city", "Lisbon").all() if h["stars"] >= 4 and h["rooms_left"] > 0]
best = min(fits, key=lambda h: (h["nightly_cents"], h["id"]))
b = one_new_booking()
if b is None:
    return TASK_FAILED_SCORE
want = ("hotel", best["id"], "2026-03-27", "2026-03-29", 1, travellers["Robin Park"], cards["Mastercard"],
        best["nightly_cents"] * 2, "confirmed")
got = (b["kind"], b["hotel_id"], b["check_in"], b["check_out"], b["passengers"], b["traveller_id"],
       b["payment_method_id"], b["total_cents"], b["status"])
if got != want:
    print(f"booking {got} != expected {want}")
    return TASK_FAILED_SCORE
if not untouched_except([b["id"]], [], [best["id"]]):
    print("other bookings, flights or hotels changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(
            Click('header a:text("Hotels")'),
            Click('input[name="city"]'),
            Type("Lisbon"),
            Click('input[name="check_in"]'),
            Type("2026-03-27"),
            Click('input[name="check_out"]'),
            Type("2026-03-29"),
            Click('input[name="min_stars"][value="4"]'),
            Click('button:text("Search hotels")'),
            Click('table.list a:text("Select") >> nth=0'),
            Click('input[name="traveller"][value="2"]'),
            Click('input[name="card"][value="2"]'),
            Click('button:text("Book now")'),
        ),
    ),
    ComputerTask(
        key="booking-cu-business-with-points",
        env_id="booking",
        prompt="Book 2 business-class seats from JFK to London Heathrow (LHR) on 2026-03-19 on the cheapest "
        "business fare that still has seats, with me as lead traveller, redeeming 5,000 loyalty points and "
        "paying the rest with the Visa.",
        doc="One new booking: the cheapest business JFK-LHR fare on 2026-03-19 with 2 seats, 2 passengers, "
        "Jamie Park, Visa, 5000 points; nothing else changed.",
        check=_BOOKING
        + """
fares = [f for f in seed.table("flights").eq("origin", "JFK").eq("destination", "LHR").eq("cabin", "business").all()
         if f["depart_at"].startswith("2026-03-19") and f["seats_left"] >= 2]
best = min(fares, key=lambda f: (f["price_cents"], f["id"]))
b = one_new_booking()
if b is None:
    return TASK_FAILED_SCORE
want = ("flight", best["id"], 2, travellers["Jamie Park"], cards["Visa"], 5000, best["price_cents"] * 2,
        best["price_cents"] * 2 - 5000)
got = (b["kind"], b["flight_id"], b["passengers"], b["traveller_id"], b["payment_method_id"], b["points_redeemed"],
       b["total_cents"], b["charged_cents"])
if got != want:
    print(f"booking {got} != expected {want}")
    return TASK_FAILED_SCORE
if not untouched_except([b["id"]], [best["id"]], []):
    print("other bookings, flights or hotels changed")
    return TASK_FAILED_SCORE
return TASK_SUCCESSFUL_SCORE
""",
        steps=(
            Navigate("flights?from=JFK&to=LHR&date=2026-03-19&cabin=business"),
            Click('a:text("Select")'),
            Click("input#passengers"),
            Key("ctrl+a"),
            Type("2"),
            Click("input#points"),
            Key("ctrl+a"),
            Type("5000"),
            Click('button:text("Book now")'),
        ),
    ),
)


# --- building -------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_app(env_id: str, db: Path) -> Iterator[str]:
    """The environment's web app on a loopback port under PREFIX, its database `db`; yields the app's URL."""
    routes = APPS[env_id](lambda: sqlite3.connect(db, check_same_thread=False, timeout=10))
    app = Starlette(routes=[Mount(PREFIX, routes=routes)])
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            threading.Event().wait(0.05)
        assert server.started, "the app server did not start"
        yield f"http://127.0.0.1:{port}{PREFIX}/"
    finally:
        server.should_exit = True
        thread.join(10)


def seed_db(env_id: str, path: Path) -> Path:
    conn = sqlite3.connect(path)
    try:
        get_environment(env_id).seed(conn)
    finally:
        conn.close()
    return path


@contextlib.asynccontextmanager
async def launched() -> AsyncIterator[Browser]:
    """Debian's Chromium (as localfleet finds it), launched as localfleet launches it."""
    executable = find_executable("")
    if executable is None:
        raise RuntimeError(f"no browser: {INSTALL_HINT}")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=executable, args=list(LAUNCH_ARGS))
        try:
            yield browser
        finally:
            await browser.close()


@contextlib.asynccontextmanager
async def screen_page(browser: Browser, width: int = WIDTH, height: int = HEIGHT) -> AsyncIterator[Page]:
    """A page in a context of its own (as each instance's screen), at the given screen size."""
    context = await browser.new_context(viewport={"width": width, "height": height})
    try:
        yield await context.new_page()
    finally:
        await context.close()


async def _step(page: Page, screen: Screen, step: Step) -> dict[str, Any]:
    """Performs one step the way the computer tool would and returns its action."""
    if isinstance(step, Navigate):
        await page.goto(urllib.parse.urljoin(page.url, step.url), wait_until="load")
        return {"action": "navigate", "url": step.url}
    if isinstance(step, Type):
        await page.keyboard.type(step.text)
        return {"action": "type", "text": step.text}
    if isinstance(step, Key):
        for chord in parse_keys(step.keys):
            await page.keyboard.press(chord)
        return {"action": "key", "text": step.keys}
    target = page.locator(step.selector)
    count = await target.count()
    assert count == 1, f"{step.selector!r} matches {count} elements on {page.url}"
    box = await target.bounding_box()
    assert box is not None, f"{step.selector!r} is not visible on {page.url}"
    x, y = round(box["x"] + box["width"] / 2), round(box["y"] + box["height"] / 2)
    assert 0 <= x < page.viewport_size["width"] and 0 <= y < page.viewport_size["height"], (  # type: ignore[index]
        f"{step.selector!r} at ({x}, {y}) is off the screen on {page.url}"
    )
    hit = await target.evaluate(
        "(el, [x, y]) => { const at = document.elementFromPoint(x, y); return el === at || el.contains(at) }", [x, y]
    )
    assert hit, f"({x}, {y}) does not hit {step.selector!r} on {page.url} (something covers it)"
    await page.mouse.click(x, y)
    return {"action": "left_click", "coordinate": [x, y]}


async def build_solution(browser: Browser, task: ComputerTask, workdir: Path) -> list[dict[str, Any]]:
    """The task's actions, found by doing them on a fresh instance; asserts that they score 1.0."""
    seed = seed_db(task.env_id, workdir / f"{task.key}-seed.db")
    current = workdir / f"{task.key}-current.db"
    shutil.copyfile(seed, current)
    actions: list[dict[str, Any]] = []
    with serve_app(task.env_id, current) as app_url:
        async with screen_page(browser) as page:
            screen = Screen(instance_id=task.key, context=page.context, page=page)
            screen.watch_navigations()
            await page.goto(app_url, wait_until="load")
            for step in task.steps:
                actions.append(await _step(page, screen, step))
                await screen.settle(10.0)  # as the computer tool does after every action
    out = execute_verifier_local(verifier_code(task), str(seed), str(current), None)
    assert out["success"] and out["result"] == 1.0, f"{task.key}: the built solution scores {out}"
    return actions


def task_json(task: ComputerTask, actions: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "key": task.key,
        "prompt": task.prompt,
        "env_id": task.env_id,
        "version": "v1",
        "task_modality": "computer_use",
        "verifier_code": verifier_code(task),
        "metadata": {
            "reference_solution": {
                "tool_calls": [{"name": "computer", "arguments": a} for a in actions],
                "final_answer": None,
            },
            # a turn per action, a screenshot to check, and room for a model's own looking around
            "max_turns": 2 * len(actions) + 6,
            "judged_by": "database",
            "screen": {"width": WIDTH, "height": HEIGHT},
        },
    }


async def build_all(tasks: Sequence[ComputerTask] = TASKS) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="computer-tasks-") as tmp:
        async with launched() as browser:
            return [task_json(task, await build_solution(browser, task, Path(tmp))) for task in tasks]


def render(tasks: list[dict[str, Any]]) -> str:
    return json.dumps({"tasks": tasks}, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    TASK_FILE.write_text(render(asyncio.run(build_all())))
    print(f"wrote {TASK_FILE} ({len(TASKS)} tasks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
