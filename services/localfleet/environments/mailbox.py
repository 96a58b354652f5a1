"""`mailbox:v1` — an Outlook-like mail client: folders, list/search, read, send, reply, move, flag, delete.

The logged-in user is Alex Morgan <alex.morgan@northwind.example>. Reading a message never changes it
(use `mark_read`); deleting moves to Trash.
"""

from __future__ import annotations

import random
import sqlite3
from datetime import datetime, timedelta
from typing import Annotated, Any

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from rlgate.localfleet.environments._support import (
    COMPANIES,
    app_clock,
    create_schema,
    like_pattern,
    meta,
    require,
    row,
    rows,
    scalar,
    slug,
    unique_names,
    webui_routes,
    write,
)
from rlgate.localfleet.environments.base import EnvironmentSpec, instance_db

USER_NAME = "Alex Morgan"
USER_EMAIL = "alex.morgan@northwind.example"
TODAY = "2026-03-02"
SYSTEM_FOLDERS = ("Inbox", "Sent", "Drafts", "Archive", "Trash", "Spam")
CUSTOM_FOLDERS = ("Projects", "Receipts", "Travel")
NO_MOVE_INTO = ("Sent", "Drafts")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS folders (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE COLLATE NOCASE,
    is_system INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS contacts (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    email TEXT NOT NULL UNIQUE,
    company TEXT NOT NULL,
    phone TEXT NOT NULL,
    is_favorite INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    folder_id INTEGER NOT NULL REFERENCES folders(id),
    thread_id INTEGER NOT NULL,
    in_reply_to INTEGER REFERENCES messages(id),
    from_name TEXT NOT NULL,
    from_addr TEXT NOT NULL,
    to_addrs TEXT NOT NULL,
    cc_addrs TEXT NOT NULL DEFAULT '',
    subject TEXT NOT NULL,
    body TEXT NOT NULL,
    sent_at TEXT NOT NULL,
    is_read INTEGER NOT NULL DEFAULT 0,
    is_flagged INTEGER NOT NULL DEFAULT 0,
    has_attachment INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS messages_folder ON messages(folder_id, sent_at);
CREATE INDEX IF NOT EXISTS messages_from ON messages(from_addr);
"""

# (subject template, body template, folder) — {n}, {q}, {day}, {project}, {city}, {code} are filled in.
_TEMPLATES: tuple[tuple[str, str, str], ...] = (
    (
        "Q{q} budget review",
        "Hi Alex,\n\nAttached is the draft Q{q} budget. Can you review the travel line before Thursday?\n\nThanks",
        "Inbox",
    ),
    ("Lunch on {day}?", "Are you free for lunch on {day}? The new place near the office has good reviews.", "Inbox"),
    (
        "{project} status update",
        "Quick update on {project}: the milestone slipped by a week because of the vendor API. Details in the tracker.",
        "Inbox",
    ),
    ("Invoice #{n}", "Please find invoice #{n} attached. Payment is due within 30 days.", "Receipts"),
    ("Your receipt from {company}", "Thank you for your purchase. Order {code} total: ${pct}.00.", "Receipts"),
    ("Flight confirmation {code}", "Your flight to {city} is confirmed. Booking reference {code}.", "Travel"),
    ("Hotel reservation in {city}", "Your stay in {city} is booked. Check-in from 15:00.", "Travel"),
    (
        "{project} design review notes",
        "Notes from today's design review of {project} are in the shared doc. Action items assigned at the bottom.",
        "Projects",
    ),
    ("Re: {project} launch checklist", "I added the security sign-off to the {project} launch checklist.", "Projects"),
    ("Offsite agenda", "Draft agenda for the offsite in {city}. Please add topics by {day}.", "Inbox"),
    (
        "Contract renewal with {company}",
        "The contract with {company} renews next month. Do we want to renegotiate the support tier?",
        "Inbox",
    ),
    ("Interview feedback", "Please submit your feedback for Thursday's candidate by end of day {day}.", "Inbox"),
    ("Weekly metrics", "Active users up {pct}% week over week. Full dashboard linked.", "Archive"),
    ("Team photo from {city}", "Here are the photos from the trip to {city}!", "Archive"),
    ("You have won a prize!!!", "Click here to claim your reward of ${pct},000 now.", "Spam"),
    (
        "Security alert for your account",
        "Unusual sign-in from {city}. If this wasn't you, reset your password.",
        "Inbox",
    ),
)
_SENT_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("Re: Q{q} budget review", "Looks good to me, one comment on the travel line."),
    ("Notes from {day}", "Sharing my notes from the meeting on {day}."),
    ("{project} next steps", "Proposed next steps for {project} attached; let's discuss on {day}."),
    ("Re: Lunch on {day}?", "Sounds great, see you at noon."),
)
_PROJECTS = ("Atlas", "Beacon", "Cobalt", "Delta", "Ember", "Falcon", "Granite", "Harbor")
_CITIES = ("Lisbon", "Tokyo", "Chicago", "Berlin", "Nairobi", "Toronto", "Singapore", "Madrid")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")


def seed(conn: sqlite3.Connection) -> None:
    """Deterministic: the same ~430 messages and 60 contacts on every call."""
    create_schema(conn, SCHEMA)
    rng = random.Random(20260302)
    conn.executemany(
        "INSERT INTO meta VALUES (?, ?)", [("today", TODAY), ("user_name", USER_NAME), ("user_email", USER_EMAIL)]
    )
    folder_ids: dict[str, int] = {}
    for i, name in enumerate(SYSTEM_FOLDERS + CUSTOM_FOLDERS, start=1):
        conn.execute("INSERT INTO folders VALUES (?, ?, ?)", (i, name, int(name in SYSTEM_FOLDERS)))
        folder_ids[name] = i

    contacts: list[tuple[str, str, str]] = []
    for i, name in enumerate(unique_names(rng, 60), start=1):
        company, domain = rng.choice(COMPANIES)
        email = f"{slug(name)}@{domain}"
        contacts.append((name, email, company))
        conn.execute(
            "INSERT INTO contacts VALUES (?, ?, ?, ?, ?, ?)",
            (
                i,
                name,
                email,
                company,
                f"+1-555-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}",
                int(rng.random() < 0.15),
            ),
        )

    today = datetime.fromisoformat(TODAY + "T09:00:00")

    def values() -> dict[str, Any]:
        """One message's placeholder values, so its subject and body agree."""
        return {
            "n": rng.randint(1000, 9999),
            "pct": rng.randint(3, 40),
            "q": rng.randint(1, 4),
            "day": rng.choice(_DAYS),
            "project": rng.choice(_PROJECTS),
            "city": rng.choice(_CITIES),
            "company": rng.choice(COMPANIES)[0],
            "code": "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(6)),
        }

    msgs: list[tuple[Any, ...]] = []
    for _ in range(370):
        subj_t, body_t, folder = rng.choice(_TEMPLATES)
        if folder == "Inbox" and rng.random() < 0.18:
            folder = rng.choice(("Archive", "Archive", "Trash"))
        name, email, _company = rng.choice(contacts)
        sent_at = today - timedelta(days=rng.randint(0, 90), minutes=rng.randint(0, 600))
        unread = folder in ("Inbox", "Spam", "Projects") and rng.random() < 0.35
        cc = rng.choice(contacts)[1] if rng.random() < 0.2 else ""
        v = values()
        msgs.append(
            (
                folder_ids[folder],
                name,
                email,
                USER_EMAIL,
                cc,
                subj_t.format(**v),
                body_t.format(**v),
                sent_at.strftime("%Y-%m-%dT%H:%M:00"),
                int(not unread),
                int(folder != "Spam" and rng.random() < 0.08),
                int(rng.random() < 0.25),
            )
        )
    for _ in range(60):
        subj_t, body_t = rng.choice(_SENT_TEMPLATES)
        to = rng.choice(contacts)[1]
        sent_at = today - timedelta(days=rng.randint(0, 90), minutes=rng.randint(0, 600))
        v = values()
        msgs.append(
            (
                folder_ids["Sent"],
                USER_NAME,
                USER_EMAIL,
                to,
                "",
                subj_t.format(**v),
                body_t.format(**v),
                sent_at.strftime("%Y-%m-%dT%H:%M:00"),
                1,
                0,
                0,
            )
        )
    msgs.sort(key=lambda m: m[7])  # ids in time order, like a real mailbox
    for i, m in enumerate(msgs, start=1):
        conn.execute(
            "INSERT INTO messages (id, folder_id, thread_id, from_name, from_addr, to_addrs, cc_addrs, subject,"
            " body, sent_at, is_read, is_flagged, has_attachment) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (i, m[0], i, *m[1:]),
        )
    conn.commit()


# --- tool results ---


class FolderInfo(BaseModel):
    name: str
    total: int
    unread: int
    is_system: bool


class FolderList(BaseModel):
    folders: list[FolderInfo]


class MessageSummary(BaseModel):
    id: int
    folder: str
    from_name: str
    from_addr: str
    subject: str
    sent_at: str = Field(description="ISO 8601 local time")
    is_read: bool
    is_flagged: bool
    has_attachment: bool
    snippet: str


class MessagePage(BaseModel):
    total: int = Field(description="Matching messages in all pages")
    offset: int
    messages: list[MessageSummary]


class Message(MessageSummary):
    to: list[str]
    cc: list[str]
    body: str
    thread_id: int
    in_reply_to: int | None


class Contact(BaseModel):
    id: int
    name: str
    email: str
    company: str
    phone: str
    is_favorite: bool


class ContactList(BaseModel):
    contacts: list[Contact]


class UpdateResult(BaseModel):
    updated: list[int] = Field(description="Ids of the messages changed")
    folder: str | None = None


MessageId = Annotated[int, Field(ge=1, description="Message id from list_messages or search_messages")]
MessageIds = Annotated[list[int], Field(min_length=1, max_length=100, description="Message ids (1-100)")]
FolderName = Annotated[
    str, Field(min_length=1, max_length=64, description="Folder name, case-insensitive, e.g. 'Inbox' or 'Archive'")
]
Email = Annotated[str, Field(pattern=r"^[^@\s,]+@[^@\s,]+\.[^@\s,]+$", max_length=254)]
Limit = Annotated[int, Field(ge=1, le=100, description="Page size (1-100)")]
Offset = Annotated[int, Field(ge=0, description="Messages to skip (for paging)")]
UnreadOnly = Annotated[bool, Field(description="Only unread messages")]
Body = Annotated[str, Field(min_length=1, max_length=10000, description="Plain-text message body")]
Subject = Annotated[str, Field(min_length=1, max_length=200, description="Subject line")]
NewFolderName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=64,
        pattern=r"^[\w][\w .&-]*$",
        description="New folder name (letters, digits, spaces, '.', '&', '-')",
    ),
]

_SUMMARY_SQL = "SELECT m.*, f.name AS folder FROM messages m JOIN folders f ON f.id = m.folder_id"


def _summary(r: dict[str, Any]) -> MessageSummary:
    body = " ".join(str(r["body"]).split())
    return MessageSummary(
        id=r["id"],
        folder=r["folder"],
        from_name=r["from_name"],
        from_addr=r["from_addr"],
        subject=r["subject"],
        sent_at=r["sent_at"],
        is_read=bool(r["is_read"]),
        is_flagged=bool(r["is_flagged"]),
        has_attachment=bool(r["has_attachment"]),
        snippet=body[:80],
    )


def _split(addrs: str) -> list[str]:
    return [a for a in addrs.split(",") if a]


def _folder(conn: sqlite3.Connection, name: str) -> dict[str, Any]:
    found = row(conn, "SELECT * FROM folders WHERE name = ? COLLATE NOCASE", (name.strip(),))
    if found is None:
        names = ", ".join(r["name"] for r in rows(conn, "SELECT name FROM folders ORDER BY id"))
        raise ToolError(f"no folder named '{name}'; folders are: {names}")
    return found


def _message(conn: sqlite3.Connection, message_id: int) -> dict[str, Any]:
    return require(conn, _SUMMARY_SQL + " WHERE m.id = ?", (message_id,), f"no message with id {message_id}")


def _check_ids(conn: sqlite3.Connection, ids: list[int]) -> list[int]:
    unique = sorted(set(ids))
    marks = ",".join("?" * len(unique))
    found = {r["id"] for r in rows(conn, f"SELECT id FROM messages WHERE id IN ({marks})", unique)}
    missing = [i for i in unique if i not in found]
    if missing:
        raise ToolError(f"no message with id {', '.join(map(str, missing))}; nothing was changed")
    return unique


def _insert_sent(
    conn: sqlite3.Connection,
    *,
    to: list[str],
    cc: list[str],
    subject: str,
    body: str,
    thread_id: int | None,
    in_reply_to: int | None,
) -> int:
    sent_folder = _folder(conn, "Sent")["id"]
    next_id = int(scalar(conn, "SELECT COALESCE(MAX(id), 0) + 1 FROM messages"))
    conn.execute(
        "INSERT INTO messages (id, folder_id, thread_id, in_reply_to, from_name, from_addr, to_addrs, cc_addrs,"
        " subject, body, sent_at, is_read, is_flagged, has_attachment) VALUES (?,?,?,?,?,?,?,?,?,?,?,1,0,0)",
        (
            next_id,
            sent_folder,
            thread_id or next_id,
            in_reply_to,
            meta(conn, "user_name"),
            meta(conn, "user_email"),
            ",".join(to),
            ",".join(cc),
            subject,
            body,
            app_clock(conn, "SELECT MAX(sent_at) FROM messages"),
        ),
    )
    return next_id


# --- operations: the one code path of the MCP tools and the web UI (services/localfleet/webui/mailbox.py) ---
# Each takes the instance's connection and raises ToolError with a message fit for the model or the page.


def folder_list(conn: sqlite3.Connection) -> FolderList:
    """Every folder with its total and unread counts, in display order."""
    found = rows(
        conn,
        "SELECT f.name, f.is_system, COUNT(m.id) AS total,"
        " COALESCE(SUM(m.is_read = 0), 0) AS unread FROM folders f"
        " LEFT JOIN messages m ON m.folder_id = f.id GROUP BY f.id ORDER BY f.id",
    )
    return FolderList(
        folders=[
            FolderInfo(name=r["name"], total=r["total"], unread=r["unread"], is_system=bool(r["is_system"]))
            for r in found
        ]
    )


def folder_name(conn: sqlite3.Connection, name: str) -> str:
    """A folder's name as stored (names match case-insensitively); ToolError listing the folders if none."""
    return str(_folder(conn, name)["name"])


def message_page(
    conn: sqlite3.Connection,
    folder: str = "Inbox",
    *,
    unread_only: bool = False,
    flagged_only: bool = False,
    limit: int = 20,
    offset: int = 0,
) -> MessagePage:
    """One page of a folder's messages, newest first."""
    f = _folder(conn, folder)
    where = (
        " WHERE m.folder_id = ?"
        + (" AND m.is_read = 0" if unread_only else "")
        + (" AND m.is_flagged = 1" if flagged_only else "")
    )
    total = scalar(conn, "SELECT COUNT(*) FROM messages m" + where, (f["id"],))
    found = rows(
        conn,
        _SUMMARY_SQL + where + " ORDER BY m.sent_at DESC, m.id DESC LIMIT ? OFFSET ?",
        (f["id"], limit, offset),
    )
    return MessagePage(total=total, offset=offset, messages=[_summary(r) for r in found])


def search(
    conn: sqlite3.Connection,
    query: str | None = None,
    sender: str | None = None,
    folder: str | None = None,
    *,
    unread_only: bool = False,
    since: str | None = None,
    limit: int = 20,
    offset: int = 0,
) -> MessagePage:
    """Messages matching a text and/or a sender, newest first; Trash and Spam only when that folder is named."""
    if not (query and query.strip()) and not (sender and sender.strip()):
        raise ToolError("give a query or a sender to search for")
    clauses: list[str] = []
    params: list[Any] = []
    if folder is not None:
        clauses.append("m.folder_id = ?")
        params.append(_folder(conn, folder)["id"])
    else:
        clauses.append("f.name NOT IN ('Trash', 'Spam')")
    if query and query.strip():
        clauses.append("(m.subject LIKE ? ESCAPE '\\' OR m.body LIKE ? ESCAPE '\\' OR m.from_name LIKE ? ESCAPE '\\')")
        params += [like_pattern(query.strip())] * 3
    if sender and sender.strip():
        clauses.append("(m.from_addr LIKE ? ESCAPE '\\' OR m.from_name LIKE ? ESCAPE '\\')")
        params += [like_pattern(sender.strip())] * 2
    if unread_only:
        clauses.append("m.is_read = 0")
    if since:
        clauses.append("m.sent_at >= ?")
        params.append(since)
    where = " WHERE " + " AND ".join(clauses)
    total = scalar(conn, "SELECT COUNT(*) FROM messages m JOIN folders f ON f.id = m.folder_id" + where, params)
    found = rows(
        conn,
        _SUMMARY_SQL + where + " ORDER BY m.sent_at DESC, m.id DESC LIMIT ? OFFSET ?",
        [*params, limit, offset],
    )
    return MessagePage(total=total, offset=offset, messages=[_summary(r) for r in found])


def full_message(conn: sqlite3.Connection, message_id: int) -> Message:
    """One message in full (recipients, body, thread). Reading never marks it read."""
    r = _message(conn, message_id)
    return Message(
        **_summary(r).model_dump(),
        to=_split(r["to_addrs"]),
        cc=_split(r["cc_addrs"]),
        body=r["body"],
        thread_id=r["thread_id"],
        in_reply_to=r["in_reply_to"],
    )


def send(conn: sqlite3.Connection, to: list[str], subject: str, body: str, cc: list[str] | None = None) -> int:
    """Sends a new message from the logged-in user; returns the id of its copy in Sent."""
    with write(conn):
        return _insert_sent(
            conn, to=to, cc=cc or [], subject=subject.strip(), body=body, thread_id=None, in_reply_to=None
        )


def reply(conn: sqlite3.Connection, message_id: int, body: str, *, reply_all: bool = False) -> int:
    """Replies to a message (its sender; with reply_all everyone on it) in its thread; returns the reply's id."""
    original = _message(conn, message_id)
    if original["folder"] == "Trash":
        raise ToolError(f"message {message_id} is in Trash; move it out of Trash before replying")
    me = meta(conn, "user_email")
    to = _split(original["to_addrs"]) if original["from_addr"] == me else [original["from_addr"]]
    cc: list[str] = []
    if reply_all:
        others = _split(original["to_addrs"]) + _split(original["cc_addrs"])
        cc = [a for a in dict.fromkeys(others) if a != me and a not in to]
    subject = original["subject"]
    if not subject.lower().startswith("re:"):
        subject = "Re: " + subject
    with write(conn):
        return _insert_sent(
            conn, to=to, cc=cc, subject=subject, body=body, thread_id=original["thread_id"], in_reply_to=message_id
        )


def move(conn: sqlite3.Connection, message_ids: list[int], folder: str) -> UpdateResult:
    """Moves messages to a folder (never into Sent or Drafts, nor into the folder they are in)."""
    target = _folder(conn, folder)
    if target["name"] in NO_MOVE_INTO:
        raise ToolError(f"messages cannot be moved into {target['name']}")
    ids = _check_ids(conn, message_ids)
    marks = ",".join("?" * len(ids))
    already = [
        r["id"]
        for r in rows(conn, f"SELECT id FROM messages WHERE id IN ({marks}) AND folder_id = ?", [*ids, target["id"]])
    ]
    if already:
        raise ToolError(f"message {', '.join(map(str, already))} is already in {target['name']}; nothing was changed")
    with write(conn):
        conn.execute(f"UPDATE messages SET folder_id = ? WHERE id IN ({marks})", [target["id"], *ids])
    return UpdateResult(updated=ids, folder=target["name"])


def flag(conn: sqlite3.Connection, message_ids: list[int], flagged: bool = True) -> UpdateResult:
    """Flags messages for follow-up, or clears their flag."""
    ids = _check_ids(conn, message_ids)
    with write(conn):
        conn.execute(
            f"UPDATE messages SET is_flagged = ? WHERE id IN ({','.join('?' * len(ids))})", [int(flagged), *ids]
        )
    return UpdateResult(updated=ids)


def mark(conn: sqlite3.Connection, message_ids: list[int], read: bool = True) -> UpdateResult:
    """Marks messages read (or unread)."""
    ids = _check_ids(conn, message_ids)
    with write(conn):
        conn.execute(f"UPDATE messages SET is_read = ? WHERE id IN ({','.join('?' * len(ids))})", [int(read), *ids])
    return UpdateResult(updated=ids)


def delete(conn: sqlite3.Connection, message_ids: list[int]) -> UpdateResult:
    """Moves messages to Trash (those already there cannot be deleted again)."""
    ids = _check_ids(conn, message_ids)
    trash = _folder(conn, "Trash")["id"]
    marks = ",".join("?" * len(ids))
    already = [
        r["id"] for r in rows(conn, f"SELECT id FROM messages WHERE id IN ({marks}) AND folder_id = ?", [*ids, trash])
    ]
    if already:
        raise ToolError(
            f"message {', '.join(map(str, already))} is already in Trash (permanent deletion is "
            "not supported); nothing was changed"
        )
    with write(conn):
        conn.execute(f"UPDATE messages SET folder_id = ? WHERE id IN ({marks})", [trash, *ids])
    return UpdateResult(updated=ids, folder="Trash")


def find_contacts(conn: sqlite3.Connection, query: str) -> ContactList:
    """Contacts whose name, email or company contains `query` (at most 25)."""
    pattern = like_pattern(query.strip())
    found = rows(
        conn,
        "SELECT * FROM contacts WHERE name LIKE ? ESCAPE '\\' OR email LIKE ?"
        " ESCAPE '\\' OR company LIKE ? ESCAPE '\\' ORDER BY name LIMIT 25",
        (pattern, pattern, pattern),
    )
    return ContactList(contacts=[Contact(**{**r, "is_favorite": bool(r["is_favorite"])}) for r in found])


def new_folder(conn: sqlite3.Connection, name: str) -> FolderInfo:
    """Creates a custom folder (names are unique, case-insensitively)."""
    if row(conn, "SELECT id FROM folders WHERE name = ? COLLATE NOCASE", (name.strip(),)) is not None:
        raise ToolError(f"a folder named '{name.strip()}' already exists")
    with write(conn):
        conn.execute("INSERT INTO folders (name, is_system) VALUES (?, 0)", (name.strip(),))
    return FolderInfo(name=name.strip(), total=0, unread=0, is_system=False)


def register_tools(server: Any) -> None:
    """Adds the mailbox tools to an `MCPServer`."""
    read_only = ToolAnnotations(read_only_hint=True)

    @server.tool(annotations=read_only)
    def list_folders(ctx: Context) -> FolderList:
        """List every mail folder with its total and unread message counts."""
        return folder_list(instance_db(ctx))

    @server.tool(annotations=read_only)
    def list_messages(
        ctx: Context,
        folder: FolderName = "Inbox",
        unread_only: UnreadOnly = False,
        flagged_only: Annotated[bool, Field(description="Only flagged messages")] = False,
        limit: Limit = 20,
        offset: Offset = 0,
    ) -> MessagePage:
        """List messages in one folder, newest first, one page at a time.

        Returns summaries (sender, subject, date, read/flag state, a short snippet); use read_message for the
        full body and recipients.
        """
        return message_page(
            instance_db(ctx), folder, unread_only=unread_only, flagged_only=flagged_only, limit=limit, offset=offset
        )

    @server.tool(annotations=read_only)
    def search_messages(
        ctx: Context,
        query: Annotated[
            str | None,
            Field(
                max_length=200,
                description=("Text to find in the subject, body or sender name (case-insensitive substring)"),
            ),
        ] = None,
        sender: Annotated[
            str | None,
            Field(max_length=254, description=("Only messages whose sender address or name contains this text")),
        ] = None,
        folder: Annotated[str | None, Field(max_length=64, description="Limit to one folder")] = None,
        unread_only: UnreadOnly = False,
        since: Annotated[
            str | None,
            Field(pattern=r"^\d{4}-\d{2}-\d{2}$", description="Only messages sent on or after this date (YYYY-MM-DD)"),
        ] = None,
        limit: Limit = 20,
        offset: Offset = 0,
    ) -> MessagePage:
        """Search messages across all folders (or one) by text and/or sender, newest first.

        Give at least one of query or sender. Messages in Trash and Spam are included only when that folder
        is named.
        """
        return search(
            instance_db(ctx),
            query,
            sender,
            folder,
            unread_only=unread_only,
            since=since,
            limit=limit,
            offset=offset,
        )

    @server.tool(annotations=read_only)
    def read_message(ctx: Context, message_id: MessageId) -> Message:
        """Read one message in full: recipients, body, thread. Does not mark it read (use mark_read)."""
        return full_message(instance_db(ctx), message_id)

    @server.tool()
    def send_message(
        ctx: Context,
        to: Annotated[list[Email], Field(min_length=1, max_length=20, description="Recipient addresses")],
        subject: Subject,
        body: Body,
        cc: Annotated[list[Email] | None, Field(max_length=20, description="Carbon-copy addresses")] = None,
    ) -> Message:
        """Send a new email from the logged-in user. A copy is stored in Sent and returned."""
        conn = instance_db(ctx)
        return full_message(conn, send(conn, to, subject, body, cc))

    @server.tool()
    def reply_to_message(
        ctx: Context,
        message_id: MessageId,
        body: Body,
        reply_all: Annotated[bool, Field(description="Also reply to the other recipients and Cc")] = False,
    ) -> Message:
        """Reply to a message: goes to its sender (and with reply_all, everyone else on it), subject 'Re: ...',
        kept in the same thread. The reply is stored in Sent and returned."""
        conn = instance_db(ctx)
        return full_message(conn, reply(conn, message_id, body, reply_all=reply_all))

    @server.tool()
    def move_message(ctx: Context, message_ids: MessageIds, folder: FolderName) -> UpdateResult:
        """Move messages to another folder (e.g. Archive, Projects). Nothing can be moved into Sent or Drafts."""
        return move(instance_db(ctx), message_ids, folder)

    @server.tool()
    def set_flag(
        ctx: Context,
        message_ids: MessageIds,
        flagged: Annotated[bool, Field(description="true to flag, false to clear the flag")] = True,
    ) -> UpdateResult:
        """Flag messages for follow-up, or clear their flag."""
        return flag(instance_db(ctx), message_ids, flagged)

    @server.tool()
    def mark_read(
        ctx: Context,
        message_ids: MessageIds,
        read: Annotated[bool, Field(description="true marks read, false marks unread")] = True,
    ) -> UpdateResult:
        """Mark messages read (or unread)."""
        return mark(instance_db(ctx), message_ids, read)

    @server.tool(annotations=ToolAnnotations(destructive_hint=True))
    def delete_message(ctx: Context, message_ids: MessageIds) -> UpdateResult:
        """Delete messages by moving them to Trash. Messages already in Trash cannot be deleted again."""
        return delete(instance_db(ctx), message_ids)

    @server.tool(annotations=read_only)
    def lookup_contact(
        ctx: Context,
        query: Annotated[
            str,
            Field(
                min_length=1, max_length=100, description=("Part of a name, email address or company, case-insensitive")
            ),
        ],
    ) -> ContactList:
        """Find contacts in the address book by name, email or company (at most 25)."""
        return find_contacts(instance_db(ctx), query)

    @server.tool()
    def create_folder(ctx: Context, name: NewFolderName) -> FolderInfo:
        """Create a new mail folder."""
        return new_folder(instance_db(ctx), name)


SPEC = EnvironmentSpec(
    env_id="mailbox",
    version="v1",
    name="Mailbox",
    description="An Outlook-like mail client: folders, search, read, send, reply, move, flag, delete, contacts.",
    schema_sql=SCHEMA,
    seed=seed,
    register_tools=register_tools,
    app=webui_routes("mailbox"),
    env_variables={"LOGGED_IN_USER": USER_EMAIL, "LOGGED_IN_NAME": USER_NAME, "APP_TODAY": TODAY},
    mcp_era="modern",
)
