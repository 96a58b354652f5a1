"""The mailbox app's web UI: folders, message list (unread bold), a message, compose, reply, search.

Every change goes through `environments.mailbox`'s operations (the MCP tools' own code path).
"""

from __future__ import annotations

import re
import sqlite3
from typing import Annotated

from pydantic import Field, TypeAdapter
from starlette.routing import BaseRoute

from rlgate.localfleet.environments import mailbox as mb
from rlgate.localfleet.webui.base import (
    BadInput,
    Connect,
    Done,
    Html,
    Page,
    Req,
    Shell,
    back_path,
    checked,
    h,
    join,
    number,
    pager,
    routes,
    seg,
    url,
)

PER_PAGE = 15
_ADDRESSES = TypeAdapter(Annotated[list[mb.Email], Field(min_length=1, max_length=20)])
_CC = TypeAdapter(Annotated[list[mb.Email], Field(max_length=20)])
_SUBJECT = TypeAdapter(mb.Subject)
_BODY = TypeAdapter(mb.Body)
_FOLDER_NAME = TypeAdapter(mb.NewFolderName)


def _when(sent_at: str) -> str:
    return sent_at[:16].replace("T", " ")


def _sidebar(conn: sqlite3.Connection, active: str) -> Html:
    items = [Html('<a class="button primary" href="compose" style="justify-content:center">Compose</a>')]
    items.append(Html('<div class="head">Folders</div>'))
    for f in mb.folder_list(conn).folders:
        key = "folder:" + f.name.lower()
        items.append(
            h(
                '<a class="{on}" href="folder/{seg}"><span>{name}</span><span class="count">{n}</span></a>',
                on="on" if key == active else "",
                seg=seg(f.name),
                name=f.name,
                n=f.unread or "",
            )
        )
    items.append(Html('<a href="folders/new" class="muted">+ New folder</a>'))
    return join(items)


SHELL = Shell(
    name="Mail",
    user=f"{mb.USER_NAME} <{mb.USER_EMAIL}>",
    nav=(("folder", "Mail", "./"), ("contacts", "Contacts", "contacts")),
    sidebar=_sidebar,
    search=("search", "Search mail"),
)


def _message_table(req: Req, page: mb.MessagePage, path: str, **query: object) -> Html:
    """The message list with its bulk-action toolbar (checkboxes belong to the toolbar's form)."""
    toolbar = Html(
        '<form id="bulk" class="toolbar" method="post" action="messages">'
        '<button name="op" value="read">Mark read</button><button name="op" value="unread">Mark unread</button>'
        '<button name="op" value="flag">Flag</button><button name="op" value="unflag">Unflag</button>'
        '<button name="op" value="archive">Archive</button>'
        '<button name="op" value="delete" class="danger">Delete</button>'
        '<input type="text" name="folder" placeholder="Folder name" aria-label="Move to folder" style="width:110px">'
        '<button name="op" value="move">Move</button></form>'
    )
    rows = []
    for m in page.messages:
        rows.append(
            h(
                '<tr class="{cls}"><td><input type="checkbox" form="bulk" name="ids" value="{id}"'
                ' aria-label="Select message {id}"></td>'
                '<td><form class="inline" method="post" action="message/{id}/flag">'
                '<input type="hidden" name="flagged" value="{to_flag}"><input type="hidden" name="back" value="{back}">'
                '<button class="small" aria-label="{flag_label}" title="{flag_label}">{star}</button></form></td>'
                '<td title="{addr}">{sender}</td>'
                '<td><a href="message/{id}">{subject}</a> <span class="muted">- {snippet}</span></td>'
                '<td class="muted">{folder}</td><td class="muted">{when}</td></tr>',
                cls="" if m.is_read else "unread",
                back=url(path, **query, page=req.page_number() if req.page_number() > 1 else None),
                id=m.id,
                to_flag=0 if m.is_flagged else 1,
                flag_label="Unflag" if m.is_flagged else "Flag",
                star=Html("&#9733;" if m.is_flagged else "&#9734;"),
                addr=m.from_addr,
                sender=m.from_name,
                subject=m.subject,
                snippet=m.snippet,
                folder=m.folder,
                when=_when(m.sent_at),
            )
        )
    table = h(
        '<table class="list"><colgroup><col style="width:44px"><col style="width:56px"><col style="width:180px">'
        '<col><col style="width:90px"><col style="width:150px"></colgroup>'
        "<tr><th></th><th></th><th>From</th><th>Subject</th><th>Folder</th><th>Date</th></tr>{rows}</table>",
        rows=join(rows) if rows else Html('<tr><td colspan="6" class="muted">No messages</td></tr>'),
    )
    return join([toolbar, table, pager(req, path, page.total, PER_PAGE, **query)])


def folder(conn: sqlite3.Connection, req: Req) -> Page:
    name = req.path.get("name", "Inbox")
    page = mb.message_page(conn, name, limit=PER_PAGE, offset=(req.page_number() - 1) * PER_PAGE)
    shown = mb.folder_name(conn, name)
    body = join([h("<h1>{name}</h1>", name=shown), _message_table(req, page, "folder/" + seg(shown))])
    return Page(shown, body, active="folder:" + shown.lower())


def search(conn: sqlite3.Connection, req: Req) -> Page:
    q = req.arg("q").strip()[:200]
    if not q:
        return Page("Search", Html('<h1>Search</h1><p class="box">Type something in the search box.</p>'))
    page = mb.search(conn, q, limit=PER_PAGE, offset=(req.page_number() - 1) * PER_PAGE)
    body = join([h("<h1>Search: {q}</h1>", q=q), _message_table(req, page, "search", q=q)])
    return Page("Search", body)


def message(conn: sqlite3.Connection, req: Req) -> Page:
    m = mb.full_message(conn, number(req.path["id"], "message id", low=1))
    movable = [
        f.name for f in mb.folder_list(conn).folders if f.name not in (m.folder, *mb.NO_MOVE_INTO)
    ]  # the folders it can go to
    moves = join(h('<button name="folder" value="{f}" class="small">{f}</button>', f=name) for name in movable)
    body = h(
        "<h1>{subject}</h1>"
        '<div class="toolbar">'
        '<a class="button" href="message/{id}/reply">Reply</a>'
        '<a class="button" href="message/{id}/reply?all=1">Reply all</a>'
        '<form class="inline" method="post" action="message/{id}/read"><input type="hidden" name="read"'
        ' value="{to_read}"><button>{read_label}</button></form>'
        '<form class="inline" method="post" action="message/{id}/flag"><input type="hidden" name="flagged"'
        ' value="{to_flag}"><button>{flag_label}</button></form>'
        '<form class="inline" method="post" action="message/{id}/delete"><button class="danger">Delete</button></form>'
        "</div>"
        '<form class="toolbar" method="post" action="message/{id}/move">'
        '<span class="muted">Move to:</span>{moves}</form>'
        '<div class="box"><div class="grid">'
        '<span class="k muted">From</span><span>{sender} &lt;{addr}&gt;</span>'
        '<span class="k muted">To</span><span>{to}</span>'
        '<span class="k muted">Cc</span><span>{cc}</span>'
        '<span class="k muted">Date</span><span>{when}</span>'
        '<span class="k muted">Folder</span><span>{folder}{flagged}{unread}</span>'
        "</div></div>"
        '<div class="box" style="margin-top:12px"><pre class="body">{body}</pre></div>',
        subject=m.subject,
        id=m.id,
        to_read=0 if m.is_read else 1,
        read_label="Mark unread" if m.is_read else "Mark read",
        to_flag=0 if m.is_flagged else 1,
        flag_label="Unflag" if m.is_flagged else "Flag",
        moves=moves,
        sender=m.from_name,
        addr=m.from_addr,
        to=", ".join(m.to),
        cc=", ".join(m.cc) or "-",
        when=_when(m.sent_at),
        folder=m.folder,
        flagged=Html(' <span class="chip">&#9733; Flagged</span>') if m.is_flagged else "",
        unread=Html(' <span class="chip">Unread</span>') if not m.is_read else "",
        body=m.body,
    )
    return Page(m.subject, body, active="folder:" + m.folder.lower())


def _compose_form(action: str, *, to: str = "", cc: str = "", subject: str = "", fixed: bool = False) -> Html:
    head = (
        h(
            '<span class="k muted">To</span><span>{to}</span><span class="k muted">Subject</span><span>{s}</span>',
            to=to,
            s=subject,
        )
        if fixed
        else h(
            '<label class="k" for="to">To</label><input type="text" id="to" name="to" value="{to}"'
            ' placeholder="name@example.com, ...">'
            '<label class="k" for="cc">Cc</label><input type="text" id="cc" name="cc" value="{cc}">'
            '<label class="k" for="subject">Subject</label><input type="text" id="subject" name="subject" value="{s}">',
            to=to,
            cc=cc,
            s=subject,
        )
    )
    return h(
        '<form method="post" action="{action}" class="box"><div class="grid">{head}'
        '<label class="k" for="body">Message</label><textarea id="body" name="body" rows="9"></textarea>'
        '<span></span><span><button class="primary" type="submit">Send</button></span></div></form>',
        action=action,
        head=head,
    )


def compose(conn: sqlite3.Connection, req: Req) -> Page:
    body = join([Html("<h1>New message</h1>"), _compose_form("compose", to=req.arg("to")[:1000])])
    return Page("New message", body, active="compose")


def reply_form(conn: sqlite3.Connection, req: Req) -> Page:
    m = mb.full_message(conn, number(req.path["id"], "message id", low=1))
    reply_all = req.arg("all") == "1"
    to = m.from_addr + (" (and everyone on the message)" if reply_all else "")
    subject = m.subject if m.subject.lower().startswith("re:") else "Re: " + m.subject
    action = f"message/{m.id}/reply" + ("?all=1" if reply_all else "")
    body = join(
        [
            h("<h1>{title}</h1>", title="Reply all" if reply_all else "Reply"),
            _compose_form(action, to=to, subject=subject, fixed=True),
            h('<h2>Original message</h2><div class="box"><pre class="body">{b}</pre></div>', b=m.body),
        ]
    )
    return Page("Reply", body, active="folder:" + m.folder.lower())


def new_folder_form(conn: sqlite3.Connection, req: Req) -> Page:
    body = Html(
        '<h1>New folder</h1><form method="post" action="folders/new" class="box"><div class="grid">'
        '<label class="k" for="name">Folder name</label><input type="text" id="name" name="name">'
        '<span></span><span><button class="primary" type="submit">Create folder</button></span></div></form>'
    )
    return Page("New folder", body)


def contacts(conn: sqlite3.Connection, req: Req) -> Page:
    q = req.arg("q").strip()[:100]
    found = mb.find_contacts(conn, q).contacts
    rows = join(
        h(
            '<tr><td>{name}</td><td><a href="{compose}">{email}</a></td><td>{company}</td><td>{phone}</td></tr>',
            name=c.name + (" \u2605" if c.is_favorite else ""),
            compose=url("compose", to=c.email),
            email=c.email,
            company=c.company,
            phone=c.phone,
        )
        for c in found[:PER_PAGE]
    )
    body = h(
        '<h1>Contacts</h1><form class="toolbar" method="get" action="contacts"><input type="text" name="q"'
        ' value="{q}" placeholder="Name, email or company" aria-label="Find contact" style="width:300px">'
        '<button type="submit">Find</button></form>'
        '<table class="list"><tr><th>Name</th><th>Email</th><th>Company</th><th>Phone</th></tr>{rows}</table>'
        '<p class="muted">{n}</p>',
        q=q,
        rows=rows,
        n=f"{len(found)} shown (at most 25; refine the search to find others)",
    )
    return Page("Contacts", body, active="contacts")


# --- actions ---


def _id(req: Req) -> int:
    return number(req.path["id"], "message id", low=1)


def _flag_value(req: Req, name: str) -> bool:
    value = req.value(name, "1")
    if value not in ("0", "1"):
        raise BadInput(f"{name} must be 0 or 1")
    return value == "1"


def set_read(conn: sqlite3.Connection, req: Req) -> Done:
    read = _flag_value(req, "read")
    mb.mark(conn, [_id(req)], read)
    return Done(f"message/{_id(req)}", "Marked read" if read else "Marked unread")


def set_flag(conn: sqlite3.Connection, req: Req) -> Done:
    flagged = _flag_value(req, "flagged")
    mb.flag(conn, [_id(req)], flagged)
    return Done(back_path(req.value("back"), f"message/{_id(req)}"), "Flagged" if flagged else "Flag cleared")


def move(conn: sqlite3.Connection, req: Req) -> Done:
    result = mb.move(conn, [_id(req)], req.value("folder").strip() or "(none)")
    return Done(f"folder/{seg(result.folder or 'Inbox')}", f"Moved to {result.folder}")


def delete(conn: sqlite3.Connection, req: Req) -> Done:
    source = mb.full_message(conn, _id(req)).folder
    mb.delete(conn, [_id(req)])
    return Done(f"folder/{seg(source)}", "Moved to Trash")


def bulk(conn: sqlite3.Connection, req: Req) -> Done:
    raw = req.values("ids")
    if not raw:
        raise BadInput("select at least one message first")
    ids = [number(i, "message id", low=1) for i in raw[:100]]
    op = req.value("op")
    first = mb.full_message(conn, ids[0]).folder
    if op in ("read", "unread"):
        mb.mark(conn, ids, op == "read")
    elif op in ("flag", "unflag"):
        mb.flag(conn, ids, op == "flag")
    elif op == "archive":
        mb.move(conn, ids, "Archive")
    elif op == "move":
        target = req.value("folder").strip()
        if not target:
            raise BadInput("type the name of the folder to move to")
        mb.move(conn, ids, target)
    elif op == "delete":
        mb.delete(conn, ids)
    else:
        raise BadInput("choose an action")
    n = len(set(ids))
    verb = {"read": "marked read", "unread": "marked unread", "flag": "flagged", "unflag": "unflagged"}
    return Done(f"folder/{seg(first)}", f"{n} message{'s' if n != 1 else ''} {verb.get(op, 'moved')}")


def _addresses(text: str, adapter: TypeAdapter[list[str]], what: str) -> list[str]:
    return list(checked(adapter, [a for a in re.split(r"[,;\s]+", text) if a], what))


def send(conn: sqlite3.Connection, req: Req) -> Done:
    to = _addresses(req.value("to"), _ADDRESSES, "To")
    cc = _addresses(req.value("cc"), _CC, "Cc")
    subject = checked(_SUBJECT, req.value("subject").strip(), "Subject")
    body = checked(_BODY, req.value("body"), "Message")
    new_id = mb.send(conn, to, subject, body, cc)
    return Done(f"message/{new_id}", "Message sent")


def reply(conn: sqlite3.Connection, req: Req) -> Done:
    body = checked(_BODY, req.value("body"), "Message")
    new_id = mb.reply(conn, _id(req), body, reply_all=req.arg("all") == "1")
    return Done(f"message/{new_id}", "Reply sent")


def create_folder(conn: sqlite3.Connection, req: Req) -> Done:
    name = checked(_FOLDER_NAME, req.value("name").strip(), "Folder name")
    created = mb.new_folder(conn, name)
    return Done(f"folder/{seg(created.name)}", f"Folder {created.name} created")


def app_routes(connect: Connect) -> list[BaseRoute]:
    """The mailbox UI's routes, relative to the app root."""
    return routes(
        SHELL,
        connect,
        pages=[
            ("/", folder),  # the Inbox, at the app's own URL (where a screen opens)
            ("/folder/{name}", folder),
            ("/search", search),
            ("/message/{id}", message),
            ("/message/{id}/reply", reply_form),
            ("/compose", compose),
            ("/folders/new", new_folder_form),
            ("/contacts", contacts),
        ],
        actions=[
            ("/message/{id}/read", set_read),
            ("/message/{id}/flag", set_flag),
            ("/message/{id}/move", move),
            ("/message/{id}/delete", delete),
            ("/message/{id}/reply", reply),
            ("/messages", bulk),
            ("/compose", send),
            ("/folders/new", create_folder),
        ],
    )
