"""The tracker app's web UI: repositories, issue lists with filters, an issue (comment, close/reopen, assignee,
labels), new issue, search.

Every change goes through `environments.tracker`'s operations (the MCP tools' own code path).
"""

from __future__ import annotations

import sqlite3

from pydantic import TypeAdapter
from starlette.routing import BaseRoute

from rlgate.localfleet.environments import tracker as tr
from rlgate.localfleet.webui.base import (
    BadInput,
    Connect,
    Done,
    Html,
    Page,
    Req,
    Shell,
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
_TITLE = TypeAdapter(tr.Title)
_BODY = TypeAdapter(tr.Body)
_STATES = ("open", "closed", "all")


def _repo_path(full_name: str) -> str:
    owner, _, name = full_name.partition("/")
    return f"r/{seg(owner)}/{seg(name)}"


def _sidebar(conn: sqlite3.Connection, active: str) -> Html:
    items = [Html('<div class="head">Repositories</div>')]
    current = active.partition("|")[0]
    for r in tr.repo_list(conn).repos:
        items.append(
            h(
                '<a class="{on}" href="{href}"><span>{name}</span><span class="count">{n}</span></a>',
                on="on" if current == "repo:" + r.full_name else "",
                href=_repo_path(r.full_name),
                name=r.full_name.partition("/")[2],
                n=r.open_issues,
            )
        )
    if current.startswith("repo:"):
        repo = current[5:]
        items.append(Html('<div class="head">Labels</div>'))
        for lab in tr.label_list(conn, repo).labels:
            items.append(
                h(
                    '<a class="{on}" href="{href}"><span><span class="chip" style="background:#{color}">&nbsp;</span>'
                    " {name}</span></a>",
                    on="on" if active.endswith("|label:" + lab.name) else "",
                    href=url(_repo_path(repo), label=lab.name),
                    color=lab.color,
                    name=lab.name,
                )
            )
    return join(items)


SHELL = Shell(
    name="Tracker",
    user=tr.USER_LOGIN,
    nav=(("repo", "Repositories", "./"),),
    sidebar=_sidebar,
    search=("search", "Search issues"),
)


def _chips(labels: list[str]) -> Html:
    return join(h('<span class="chip">{name}</span>', name=name) for name in labels)


def _issue_table(issues: list[tr.IssueSummary], with_repo: bool) -> Html:
    rows = join(
        h(
            '<tr><td class="muted">{ref}</td><td><a href="{href}">{title}</a>{chips}</td><td>{state}</td>'
            '<td>{assignee}</td><td class="muted">{comments}</td><td class="muted">{updated}</td></tr>',
            ref=(i.repo.partition("/")[2] + "#" if with_repo else "#") + str(i.number),
            href=f"{_repo_path(i.repo)}/issues/{i.number}",
            title=i.title,
            chips=_chips(i.labels),
            state=i.state,
            assignee=i.assignee or "-",
            comments=i.comments,
            updated=i.updated_at[:10],
        )
        for i in issues
    )
    return h(
        '<table class="list"><colgroup><col style="width:{w}px"><col><col style="width:70px">'
        '<col style="width:150px"><col style="width:50px"><col style="width:100px"></colgroup>'
        "<tr><th>#</th><th>Title</th><th>State</th><th>Assignee</th><th>Cmts</th><th>Updated</th></tr>"
        "{rows}</table>",
        w=140 if with_repo else 60,
        rows=rows or Html('<tr><td colspan="6" class="muted">No issues match</td></tr>'),
    )


def repos(conn: sqlite3.Connection, req: Req) -> Page:
    rows = join(
        h(
            '<tr><td><a href="{href}">{name}</a></td><td class="muted">{desc}</td><td>{vis}</td><td>{n}</td></tr>',
            href=_repo_path(r.full_name),
            name=r.full_name,
            desc=r.description,
            vis="private" if r.is_private else "public",
            n=r.open_issues,
        )
        for r in tr.repo_list(conn).repos
    )
    body = h(
        '<h1>Repositories</h1><table class="list"><colgroup><col style="width:260px"><col>'
        '<col style="width:90px"><col style="width:110px"></colgroup>'
        "<tr><th>Repository</th><th>Description</th><th>Visibility</th><th>Open issues</th></tr>{rows}</table>",
        rows=rows,
    )
    return Page("Repositories", body, active="repo")


def _full(req: Req) -> str:
    return f"{req.path['owner']}/{req.path['name']}"


def issues(conn: sqlite3.Connection, req: Req) -> Page:
    full = tr.repo_name(conn, _full(req))
    state = req.arg("state", "open")
    if state not in _STATES:
        raise BadInput(f"state must be one of {', '.join(_STATES)}")
    label = req.arg("label").strip()[:50] or None
    assignee = req.arg("assignee").strip()[:64] or None
    page = tr.issue_page(
        conn,
        full,
        state,
        label=label,
        assignee=assignee,
        limit=PER_PAGE,
        offset=(req.page_number() - 1) * PER_PAGE,
    )
    base = _repo_path(full)
    counts = {s: tr.issue_page(conn, full, s, label=label, assignee=assignee, limit=1).total for s in _STATES}
    tabs = join(
        h(
            '<a class="button{on}" href="{href}">{label} {n}</a>',
            on=" primary" if s == state else "",
            href=url(base, state=s, label=label, assignee=assignee),
            label=s.capitalize(),
            n=counts[s],
        )
        for s in _STATES
    )
    filters = []
    if label:
        filters.append(h("label <b>{v}</b>", v=label))
    if assignee:
        filters.append(h("assignee <b>{v}</b>", v=assignee))
    active = (
        h(
            ' <span class="muted">Filtered by {f}</span> <a href="{clear}">Clear filters</a>',
            f=Html(", ".join(filters)),
            clear=url(base, state=state),
        )
        if filters
        else Html("")
    )
    body = h(
        "<h1>{full} &middot; Issues</h1>"
        '<div class="toolbar">{tabs}'
        '<form class="inline toolbar" method="get" action="{base}" style="margin:0 0 0 12px">'
        '<input type="hidden" name="state" value="{state}"><input type="hidden" name="label" value="{label}">'
        '<input type="text" name="assignee" value="{assignee}" placeholder="Assignee login" aria-label="Assignee"'
        ' style="width:150px"><button type="submit">Filter</button></form>'
        '<a class="button" href="{mine}">Assigned to me</a>'
        '<a class="button primary" href="{base}/new" style="margin-left:auto">New issue</a></div>'
        "{active}{table}{pager}",
        full=full,
        tabs=tabs,
        base=base,
        state=state,
        label=label or "",
        assignee=assignee or "",
        mine=url(base, state=state, assignee=tr.USER_LOGIN),
        active=active,
        table=_issue_table(page.issues, with_repo=False),
        pager=pager(req, base, page.total, PER_PAGE, state=state, label=label, assignee=assignee),
    )
    return Page(f"{full} issues", body, active=f"repo:{full}" + (f"|label:{label}" if label else ""))


def search(conn: sqlite3.Connection, req: Req) -> Page:
    q = req.arg("q").strip()[:200]
    if not q:
        return Page("Search", Html('<h1>Search</h1><p class="box">Type something in the search box.</p>'))
    page = tr.search(conn, q, limit=PER_PAGE, offset=(req.page_number() - 1) * PER_PAGE)
    body = join(
        [
            h("<h1>Issues matching &ldquo;{q}&rdquo;</h1>", q=q),
            _issue_table(page.issues, with_repo=True),
            pager(req, "search", page.total, PER_PAGE, q=q),
        ]
    )
    return Page("Search", body)


def issue(conn: sqlite3.Connection, req: Req) -> Page:
    full = tr.repo_name(conn, _full(req))
    n = number(req.path["number"], "issue number", low=1)
    i = tr.full_issue(conn, full, n)
    action = f"{_repo_path(full)}/issues/{n}"
    if i.state == "open":
        state_buttons = Html(
            '<button name="op" value="close_completed">Close as completed</button>'
            '<button name="op" value="close_not_planned">Close as not planned</button>'
        )
    else:
        state_buttons = Html('<button name="op" value="reopen">Reopen issue</button>')
    comments = join(
        h(
            '<div class="box" style="margin-top:8px"><div class="muted"><b>{author}</b> commented on {when}</div>'
            '<pre class="body">{body}</pre></div>',
            author=c.author,
            when=c.created_at.replace("T", " ")[:16],
            body=c.body,
        )
        for c in reversed(i.comment_list)
    )
    applied = set(i.labels)
    label_buttons = join(
        h(
            '<button class="small{on}" name="{op}" value="{name}" style="width:100%;justify-content:space-between;'
            'margin-bottom:4px" title="{tip}"><span>{name}</span><span>{mark}</span></button>',
            on=" on" if lab.name in applied else "",
            op="remove" if lab.name in applied else "add",
            name=lab.name,
            tip=("Remove label " if lab.name in applied else "Add label ") + lab.name,
            mark=Html("&#10003;") if lab.name in applied else "+",
        )
        for lab in tr.label_list(conn, full).labels
    )
    reason = {"completed": "completed", "not_planned": "not planned"}.get(i.state_reason or "", "")
    body = h(
        "<h1>{title} <span class=muted>#{n}</span></h1>"
        '<div style="display:flex;gap:16px;align-items:flex-start">'
        '<div style="flex:1;min-width:0">'
        '<div class="muted" style="height:28px"><span class="badge {state}">{state_label}</span>'
        " {author} opened this on {created} &middot; {ncomments} comments</div>"
        '<div class="box" style="height:150px;overflow:auto"><pre class="body">{body}</pre></div>'
        '<form method="post" action="{action}/comment" class="box" style="margin-top:8px">'
        '<textarea name="body" rows="4" style="width:100%" placeholder="Leave a comment" aria-label="Comment">'
        "</textarea>"
        '<div class="toolbar" style="margin:8px 0 0"><button class="primary" name="op" value="comment">Comment'
        "</button>{state_buttons}</div></form>"
        "{comments}</div>"
        '<div style="width:250px;flex:none">'
        '<div class="box"><div class="muted">Assignee</div><div style="height:28px;line-height:28px"><b>{assignee}'
        '</b></div><form method="post" action="{action}/assign">'
        '<input type="text" name="assignee" placeholder="login" aria-label="Assignee login" style="width:140px">'
        ' <button name="op" value="assign" class="small">Assign</button>'
        '<div style="display:flex;gap:6px;margin-top:6px"><button name="op" value="me" class="small">Assign to me'
        '</button><button name="op" value="unassign" class="small">Unassign</button></div></form></div>'
        '<form method="post" action="{action}/labels" class="box" style="margin-top:8px">'
        '<div class="muted" style="margin-bottom:4px">Labels</div>{label_buttons}</form>'
        "</div></div>",
        title=i.title,
        n=n,
        state=i.state,
        state_label=i.state.capitalize() + (f" ({reason})" if reason else ""),
        author=i.author,
        created=i.created_at[:10],
        ncomments=i.comments,
        body=i.body,
        action=action,
        state_buttons=state_buttons,
        comments=comments,
        assignee=i.assignee or "No one",
        label_buttons=label_buttons,
    )
    return Page(f"{i.title} #{n}", body, active=f"repo:{full}")


def new_issue_form(conn: sqlite3.Connection, req: Req) -> Page:
    full = tr.repo_name(conn, _full(req))
    boxes = join(
        h(
            '<label><input type="checkbox" name="labels" value="{name}">{name}</label>',
            name=lab.name,
        )
        for lab in tr.label_list(conn, full).labels
    )
    body = h(
        "<h1>New issue in {full}</h1>"
        '<form method="post" action="{action}" class="box"><div class="grid">'
        '<label class="k" for="title">Title</label><input type="text" id="title" name="title">'
        '<label class="k" for="body">Description</label><textarea id="body" name="body" rows="6"></textarea>'
        '<span class="k muted">Labels</span><div class="choices" style="display:grid;'
        'grid-template-columns:repeat(3,1fr)">{boxes}</div>'
        '<label class="k" for="assignee">Assignee (login)</label><input type="text" id="assignee" name="assignee">'
        '<span></span><span><button class="primary" type="submit">Submit new issue</button></span></div></form>',
        full=full,
        action=f"{_repo_path(full)}/new",
        boxes=boxes,
    )
    return Page("New issue", body, active=f"repo:{full}")


# --- actions ---


def _issue_ref(conn: sqlite3.Connection, req: Req) -> tuple[str, int]:
    return tr.repo_name(conn, _full(req)), number(req.path["number"], "issue number", low=1)


def comment(conn: sqlite3.Connection, req: Req) -> Done:
    full, n = _issue_ref(conn, req)
    op = req.value("op")
    text = req.value("body").strip()
    back = f"{_repo_path(full)}/issues/{n}"
    if op == "comment":
        tr.comment(conn, full, n, checked(_BODY, text, "Comment"))
        return Done(back, "Comment added")
    if op in ("close_completed", "close_not_planned"):
        reason = op.removeprefix("close_")
        tr.close(conn, full, n, reason, checked(_BODY, text, "Comment") if text else None)
        return Done(back, "Issue closed as " + reason.replace("_", " "))
    if op == "reopen":
        if text:
            tr.comment(conn, full, n, checked(_BODY, text, "Comment"))
        tr.reopen(conn, full, n)
        return Done(back, "Issue reopened")
    raise BadInput("choose Comment, Close or Reopen")


def assign(conn: sqlite3.Connection, req: Req) -> Done:
    full, n = _issue_ref(conn, req)
    op = req.value("op")
    if op == "assign":
        login = req.value("assignee").strip()
        if not login:
            raise BadInput("type the login of the person to assign")
        who: str | None = login[:64]
    elif op == "me":
        who = tr.USER_LOGIN
    elif op == "unassign":
        who = None
    else:
        raise BadInput("choose Assign, Assign to me or Unassign")
    summary = tr.assign(conn, full, n, who)
    return Done(f"{_repo_path(full)}/issues/{n}", f"Assigned to {summary.assignee}" if who else "Unassigned")


def labels(conn: sqlite3.Connection, req: Req) -> Done:
    full, n = _issue_ref(conn, req)
    back = f"{_repo_path(full)}/issues/{n}"
    if add := req.value("add"):
        tr.label(conn, full, n, [add[:50]])
        return Done(back, f"Label {add} added")
    if remove := req.value("remove"):
        tr.unlabel(conn, full, n, remove[:50])
        return Done(back, f"Label {remove} removed")
    raise BadInput("choose a label")


def create(conn: sqlite3.Connection, req: Req) -> Done:
    full = tr.repo_name(conn, _full(req))
    title = checked(_TITLE, req.value("title").strip(), "Title")
    body = req.value("body")
    chosen = [name[:50] for name in req.values("labels")[:10]]
    assignee = req.value("assignee").strip()[:64] or None
    made = tr.create(conn, full, title, body, chosen, assignee)
    return Done(f"{_repo_path(full)}/issues/{made.number}", f"Issue #{made.number} created")


def app_routes(connect: Connect) -> list[BaseRoute]:
    """The tracker UI's routes, relative to the app root."""
    return routes(
        SHELL,
        connect,
        pages=[
            ("/", repos),
            ("/search", search),
            ("/r/{owner}/{name}", issues),
            ("/r/{owner}/{name}/new", new_issue_form),
            ("/r/{owner}/{name}/issues/{number}", issue),
        ],
        actions=[
            ("/r/{owner}/{name}/new", create),
            ("/r/{owner}/{name}/issues/{number}/comment", comment),
            ("/r/{owner}/{name}/issues/{number}/assign", assign),
            ("/r/{owner}/{name}/issues/{number}/labels", labels),
        ],
    )
