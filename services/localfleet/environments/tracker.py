"""`tracker:v1` — a GitHub-like issue tracker: repos, issues, labels, comments, assignees, close/reopen.

The logged-in user is `sam-rivera`. Repositories are named `owner/name` (e.g. `northwind/atlas-api`); a bare
name is accepted when it is unique. This environment speaks the legacy MCP era (initialize + session id).
"""

from __future__ import annotations

import random
import sqlite3
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from rlgate.localfleet.environments._support import (
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

USER_LOGIN = "sam-rivera"
TODAY = "2026-03-02"

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS users (
    id INTEGER PRIMARY KEY,
    login TEXT NOT NULL UNIQUE COLLATE NOCASE,
    name TEXT NOT NULL,
    role TEXT NOT NULL CHECK (role IN ('maintainer', 'member'))
);
CREATE TABLE IF NOT EXISTS repos (
    id INTEGER PRIMARY KEY,
    full_name TEXT NOT NULL UNIQUE COLLATE NOCASE,
    description TEXT NOT NULL,
    is_private INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS labels (
    id INTEGER PRIMARY KEY,
    repo_id INTEGER NOT NULL REFERENCES repos(id),
    name TEXT NOT NULL COLLATE NOCASE,
    color TEXT NOT NULL,
    description TEXT NOT NULL,
    UNIQUE (repo_id, name)
);
CREATE TABLE IF NOT EXISTS issues (
    id INTEGER PRIMARY KEY,
    repo_id INTEGER NOT NULL REFERENCES repos(id),
    number INTEGER NOT NULL,
    title TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('open', 'closed')),
    state_reason TEXT CHECK (state_reason IN ('completed', 'not_planned')),
    author_id INTEGER NOT NULL REFERENCES users(id),
    assignee_id INTEGER REFERENCES users(id),
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    closed_at TEXT,
    UNIQUE (repo_id, number)
);
CREATE TABLE IF NOT EXISTS issue_labels (
    issue_id INTEGER NOT NULL REFERENCES issues(id),
    label_id INTEGER NOT NULL REFERENCES labels(id),
    PRIMARY KEY (issue_id, label_id)
);
CREATE TABLE IF NOT EXISTS comments (
    id INTEGER PRIMARY KEY,
    issue_id INTEGER NOT NULL REFERENCES issues(id),
    author_id INTEGER NOT NULL REFERENCES users(id),
    body TEXT NOT NULL,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS issues_repo_state ON issues(repo_id, state);
CREATE INDEX IF NOT EXISTS comments_issue ON comments(issue_id);
"""

_REPOS = (
    ("northwind/atlas-api", "Public REST API for the Atlas platform"),
    ("northwind/atlas-web", "Atlas web dashboard (TypeScript)"),
    ("northwind/beacon-sdk", "Python SDK for Beacon telemetry"),
    ("northwind/cobalt-cli", "Command-line tool for Cobalt deployments"),
    ("northwind/infra", "Terraform and Kubernetes configuration"),
    ("northwind/docs", "Developer documentation site"),
)
_LABELS = (
    ("bug", "d73a4a", "Something isn't working"),
    ("enhancement", "a2eeef", "New feature or request"),
    ("documentation", "0075ca", "Improvements or additions to documentation"),
    ("good first issue", "7057ff", "Good for newcomers"),
    ("help wanted", "008672", "Extra attention is needed"),
    ("performance", "fbca04", "Latency, memory or throughput"),
    ("security", "b60205", "Security-relevant"),
    ("question", "d876e3", "Further information is requested"),
    ("duplicate", "cfd3d7", "This issue already exists"),
    ("wontfix", "ffffff", "This will not be worked on"),
    ("priority: high", "e11d21", "Fix in the current cycle"),
    ("priority: low", "c2e0c6", "Nice to have"),
)
_TITLES = (
    ("Crash when {action} with an empty {thing}", "bug"),
    ("{component} returns 500 when {thing} is missing", "bug"),
    ("Add support for {feature}", "enhancement"),
    ("Allow filtering {thing}s by {field}", "enhancement"),
    ("Docs: {doc} page is out of date", "documentation"),
    ("Slow {op} on large {thing}s", "performance"),
    ("Flaky test: test_{field}_{op}", "bug"),
    ("Upgrade {dep} to {ver}", "enhancement"),
    ("Token leaked in {component} debug logs", "security"),
    ("How do I configure {feature}?", "question"),
)
_WORDS = {
    "action": ("exporting", "importing", "syncing", "saving", "uploading", "deleting"),
    "thing": ("project", "dashboard", "report", "webhook", "workspace", "pipeline"),
    "component": ("the /v2/search endpoint", "the auth middleware", "the billing job", "the export worker"),
    "feature": ("SSO login", "dark mode", "CSV export", "rate-limit headers", "pagination cursors", "retries"),
    "field": ("owner", "status", "created_date", "region", "tag"),
    "doc": ("Quickstart", "Authentication", "Webhooks", "Deployment", "CLI reference"),
    "op": ("listing", "search", "rendering", "startup", "sync"),
    "dep": ("pydantic", "react", "terraform-aws", "grpcio", "openssl"),
    "ver": ("2.9", "19.1", "5.80", "1.70", "3.4"),
}
_COMMENTS = (
    "I can reproduce this on the latest main.",
    "Could you share the full stack trace?",
    "This looks related to the change in the last release.",
    "I'll take a look this week.",
    "+1, we are hitting this in production too.",
    "A fix is up for review.",
    "Is there a workaround in the meantime?",
    "Closing the loop: verified on staging.",
)


def seed(conn: sqlite3.Connection) -> None:
    """Deterministic: 30 users, 6 repos, 72 labels, ~300 issues and ~500 comments on every call."""
    create_schema(conn, SCHEMA)
    rng = random.Random(424242)
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [("today", TODAY), ("user_login", USER_LOGIN)])
    names = ["Sam Rivera", *unique_names(rng, 40)]
    users: list[str] = []
    for name in names:
        login = slug(name).replace(".", "-")
        if login in users:
            continue
        users.append(login)
        role = "maintainer" if len(users) <= 6 else "member"
        conn.execute("INSERT INTO users VALUES (?, ?, ?, ?)", (len(users), login, name, role))
        if len(users) == 30:
            break
    label_ids: dict[tuple[int, str], int] = {}
    for repo_id, (full_name, description) in enumerate(_REPOS, start=1):
        conn.execute(
            "INSERT INTO repos VALUES (?, ?, ?, ?)", (repo_id, full_name, description, int(full_name.endswith("infra")))
        )
        for name, color, label_desc in _LABELS:
            cur = conn.execute(
                "INSERT INTO labels (repo_id, name, color, description) VALUES (?, ?, ?, ?)",
                (repo_id, name, color, label_desc),
            )
            label_ids[(repo_id, name)] = int(cur.lastrowid or 0)
    end = datetime.fromisoformat(TODAY + "T08:00:00")  # nothing in the seed happens after 'today'
    start = end - timedelta(days=180)
    issue_rows: list[tuple[Any, ...]] = []
    for _ in range(300):
        repo_id = rng.randint(1, len(_REPOS))
        template, kind = rng.choice(_TITLES)
        title = template.format(**{k: rng.choice(v) for k, v in _WORDS.items()})
        title = title[0].upper() + title[1:]
        created = start + timedelta(days=rng.randint(0, 178), minutes=rng.randint(0, 900))
        issue_rows.append((created, repo_id, title, kind))
    issue_rows.sort(key=lambda r: r[0])
    numbers: dict[int, int] = {}
    comment_rows: list[tuple[int, int, str, str]] = []
    for issue_id, (created, repo_id, title, kind) in enumerate(issue_rows, start=1):
        numbers[repo_id] = numbers.get(repo_id, 0) + 1
        closed = rng.random() < 0.35
        closed_at = min(created + timedelta(days=rng.randint(1, 20)), end) if closed else None
        author = rng.randint(1, len(users))
        assignee = rng.randint(1, 12) if rng.random() < 0.55 else None
        body = (
            f"### What happened\n{title}.\n\n### Expected\nIt should work without errors.\n\n"
            f"### Environment\nversion 1.{rng.randint(0, 12)}.{rng.randint(0, 9)}"
        )
        created_s = created.strftime("%Y-%m-%dT%H:%M:00")
        conn.execute(
            "INSERT INTO issues VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                issue_id,
                repo_id,
                numbers[repo_id],
                title,
                body,
                "closed" if closed else "open",
                rng.choice(("completed", "completed", "not_planned")) if closed else None,
                author,
                assignee,
                created_s,
                (closed_at or created).strftime("%Y-%m-%dT%H:%M:00"),
                closed_at.strftime("%Y-%m-%dT%H:%M:00") if closed_at else None,
            ),
        )
        extra = rng.sample([name for name, _c, _d in _LABELS if name != kind], k=rng.choice((0, 0, 1, 1, 2)))
        for name in (kind, *extra):
            conn.execute("INSERT INTO issue_labels VALUES (?, ?)", (issue_id, label_ids[(repo_id, name)]))
        for k in range(rng.choice((0, 1, 1, 2, 2, 3))):
            when = min(created + timedelta(hours=6 * (k + 1) + rng.randint(0, 40)), end)
            comment_rows.append(
                (issue_id, rng.randint(1, len(users)), rng.choice(_COMMENTS), when.strftime("%Y-%m-%dT%H:%M:00"))
            )
    comment_rows.sort(key=lambda c: c[3])
    conn.executemany("INSERT INTO comments (issue_id, author_id, body, created_at) VALUES (?, ?, ?, ?)", comment_rows)
    conn.commit()


# --- tool results ---


class Repo(BaseModel):
    full_name: str
    description: str
    is_private: bool
    open_issues: int


class RepoList(BaseModel):
    repos: list[Repo]


class IssueSummary(BaseModel):
    repo: str
    number: int
    title: str
    state: Literal["open", "closed"]
    state_reason: Literal["completed", "not_planned"] | None
    author: str
    assignee: str | None
    labels: list[str]
    comments: int
    created_at: str
    updated_at: str


class IssuePage(BaseModel):
    total: int = Field(description="Matching issues in all pages")
    offset: int
    issues: list[IssueSummary]


class Comment(BaseModel):
    id: int
    author: str
    body: str
    created_at: str


class Issue(IssueSummary):
    body: str
    closed_at: str | None
    comment_list: list[Comment]


class Label(BaseModel):
    name: str
    color: str
    description: str
    open_issues: int


class LabelList(BaseModel):
    repo: str
    labels: list[Label]


class User(BaseModel):
    login: str
    name: str
    role: Literal["maintainer", "member"]


class UserList(BaseModel):
    users: list[User]


RepoName = Annotated[
    str, Field(min_length=1, max_length=100, description="Repository as 'owner/name' (e.g. 'northwind/atlas-api')")
]
IssueNumber = Annotated[int, Field(ge=1, description="Issue number within the repository")]
Login = Annotated[str, Field(min_length=1, max_length=64, description="User login, e.g. 'sam-rivera'")]
LabelName = Annotated[str, Field(min_length=1, max_length=50, description="Label name, e.g. 'bug'")]
State = Annotated[Literal["open", "closed", "all"], Field(description="Issue state to include")]
Limit = Annotated[int, Field(ge=1, le=100, description="Page size (1-100)")]
Offset = Annotated[int, Field(ge=0, description="Issues to skip (for paging)")]
Body = Annotated[str, Field(min_length=1, max_length=20000, description="Markdown text")]
Title = Annotated[str, Field(min_length=3, max_length=200, description="Issue title")]

_ISSUE_SQL = (
    "SELECT i.*, r.full_name AS repo, a.login AS author, s.login AS assignee,"
    " (SELECT COUNT(*) FROM comments c WHERE c.issue_id = i.id) AS n_comments,"
    " (SELECT GROUP_CONCAT(name, '|') FROM (SELECT l.name FROM issue_labels il JOIN labels l ON l.id = il.label_id"
    "   WHERE il.issue_id = i.id ORDER BY l.name)) AS label_names"
    " FROM issues i JOIN repos r ON r.id = i.repo_id JOIN users a ON a.id = i.author_id"
    " LEFT JOIN users s ON s.id = i.assignee_id"
)


def _summary(r: dict[str, Any]) -> IssueSummary:
    return IssueSummary(
        repo=r["repo"],
        number=r["number"],
        title=r["title"],
        state=r["state"],
        state_reason=r["state_reason"],
        author=r["author"],
        assignee=r["assignee"],
        labels=r["label_names"].split("|") if r["label_names"] else [],
        comments=r["n_comments"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
    )


def _repo(conn: sqlite3.Connection, name: str) -> dict[str, Any]:
    name = name.strip().strip("/")
    found = row(conn, "SELECT * FROM repos WHERE full_name = ?", (name,))
    if found is None and "/" not in name:
        matches = rows(conn, "SELECT * FROM repos WHERE full_name LIKE ?", ("%/" + name,))
        found = matches[0] if len(matches) == 1 else None
    if found is None:
        known = ", ".join(r["full_name"] for r in rows(conn, "SELECT full_name FROM repos ORDER BY id"))
        raise ToolError(f"no repository '{name}'; repositories are: {known}")
    return found


def _issue(conn: sqlite3.Connection, repo: str, number: int) -> dict[str, Any]:
    r = _repo(conn, repo)
    return require(
        conn,
        _ISSUE_SQL + " WHERE i.repo_id = ? AND i.number = ?",
        (r["id"], number),
        f"{r['full_name']} has no issue #{number}",
    )


def _user(conn: sqlite3.Connection, login: str) -> dict[str, Any]:
    return require(
        conn,
        "SELECT * FROM users WHERE login = ?",
        (login.strip().lstrip("@"),),
        f"no user with login '{login}'; use list_users to find logins",
    )


def _labels(conn: sqlite3.Connection, repo_id: int, repo_name: str, names: list[str]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for name in dict.fromkeys(n.strip() for n in names):
        label = row(conn, "SELECT * FROM labels WHERE repo_id = ? AND name = ?", (repo_id, name))
        if label is None:
            raise ToolError(f"{repo_name} has no label '{name}'; use list_labels to see its labels")
        found.append(label)
    return found


def _me(conn: sqlite3.Connection) -> int:
    return int(_user(conn, meta(conn, "user_login"))["id"])


def _now(conn: sqlite3.Connection) -> str:
    return app_clock(
        conn,
        "SELECT MAX(m) FROM (SELECT MAX(updated_at) AS m FROM issues UNION ALL SELECT MAX(created_at) FROM comments)",
    )


def _touch(conn: sqlite3.Connection, issue_id: int) -> None:
    conn.execute("UPDATE issues SET updated_at = ? WHERE id = ?", (_now(conn), issue_id))


# --- operations: the one code path of the MCP tools and the web UI (services/localfleet/webui/tracker.py) ---
# Each takes the instance's connection and raises ToolError with a message fit for the model or the page.


def repo_list(conn: sqlite3.Connection) -> RepoList:
    """Every repository with its open issue count."""
    found = rows(
        conn,
        "SELECT r.*, (SELECT COUNT(*) FROM issues i WHERE i.repo_id = r.id"
        " AND i.state = 'open') AS open_issues FROM repos r ORDER BY r.id",
    )
    return RepoList(
        repos=[
            Repo(
                full_name=r["full_name"],
                description=r["description"],
                is_private=bool(r["is_private"]),
                open_issues=r["open_issues"],
            )
            for r in found
        ]
    )


def repo_name(conn: sqlite3.Connection, name: str) -> str:
    """A repository's full name as stored ('owner/name'; a unique bare name is accepted); ToolError if none."""
    return str(_repo(conn, name)["full_name"])


def issue_page(
    conn: sqlite3.Connection,
    repo: str,
    state: str = "open",
    *,
    label: str | None = None,
    assignee: str | None = None,
    author: str | None = None,
    limit: int = 30,
    offset: int = 0,
) -> IssuePage:
    """One page of a repository's issues, newest first; `assignee='none'` means unassigned."""
    r = _repo(conn, repo)
    clauses, params = ["i.repo_id = ?"], [r["id"]]
    if state != "all":
        clauses.append("i.state = ?")
        params.append(state)
    if label:
        lab = _labels(conn, r["id"], r["full_name"], [label])[0]
        clauses.append("EXISTS (SELECT 1 FROM issue_labels il WHERE il.issue_id = i.id AND il.label_id = ?)")
        params.append(lab["id"])
    if assignee and assignee.strip().lower() == "none":
        clauses.append("i.assignee_id IS NULL")
    elif assignee:
        clauses.append("i.assignee_id = ?")
        params.append(_user(conn, assignee)["id"])
    if author:
        clauses.append("i.author_id = ?")
        params.append(_user(conn, author)["id"])
    where = " WHERE " + " AND ".join(clauses)
    total = scalar(conn, "SELECT COUNT(*) FROM issues i" + where, params)
    found = rows(conn, _ISSUE_SQL + where + " ORDER BY i.number DESC LIMIT ? OFFSET ?", [*params, limit, offset])
    return IssuePage(total=total, offset=offset, issues=[_summary(x) for x in found])


def search(
    conn: sqlite3.Connection,
    query: str,
    repo: str | None = None,
    state: str = "all",
    *,
    limit: int = 30,
    offset: int = 0,
) -> IssuePage:
    """Issues whose title or body contains `query`, across repositories (or one), newest first."""
    if not query.strip():
        raise ToolError("give some text to search for")
    pattern = like_pattern(query.strip())
    clauses = ["(i.title LIKE ? ESCAPE '\\' OR i.body LIKE ? ESCAPE '\\')"]
    params: list[Any] = [pattern, pattern]
    if repo:
        clauses.append("i.repo_id = ?")
        params.append(_repo(conn, repo)["id"])
    if state != "all":
        clauses.append("i.state = ?")
        params.append(state)
    where = " WHERE " + " AND ".join(clauses)
    total = scalar(conn, "SELECT COUNT(*) FROM issues i" + where, params)
    found = rows(
        conn,
        _ISSUE_SQL + where + " ORDER BY i.created_at DESC, i.id DESC LIMIT ? OFFSET ?",
        [*params, limit, offset],
    )
    return IssuePage(total=total, offset=offset, issues=[_summary(x) for x in found])


def full_issue(conn: sqlite3.Connection, repo: str, number: int) -> Issue:
    """One issue in full, with its comments in order."""
    r = _issue(conn, repo, number)
    comments = rows(
        conn,
        "SELECT c.id, u.login AS author, c.body, c.created_at FROM comments c"
        " JOIN users u ON u.id = c.author_id WHERE c.issue_id = ? ORDER BY c.id",
        (r["id"],),
    )
    return Issue(
        **_summary(r).model_dump(),
        body=r["body"],
        closed_at=r["closed_at"],
        comment_list=[Comment(**c) for c in comments],
    )


def create(
    conn: sqlite3.Connection,
    repo: str,
    title: str,
    body: str = "",
    labels: list[str] | None = None,
    assignee: str | None = None,
) -> Issue:
    """Opens an issue as the logged-in user, optionally labelled and assigned."""
    r = _repo(conn, repo)
    labs = _labels(conn, r["id"], r["full_name"], labels or [])
    assignee_id = _user(conn, assignee)["id"] if assignee else None
    with write(conn):
        number = int(scalar(conn, "SELECT COALESCE(MAX(number), 0) + 1 FROM issues WHERE repo_id = ?", (r["id"],)))
        now = _now(conn)
        cur = conn.execute(
            "INSERT INTO issues (repo_id, number, title, body, state, author_id, assignee_id, created_at,"
            " updated_at) VALUES (?, ?, ?, ?, 'open', ?, ?, ?, ?)",
            (r["id"], number, title.strip(), body, _me(conn), assignee_id, now, now),
        )
        conn.executemany("INSERT INTO issue_labels VALUES (?, ?)", [(cur.lastrowid, lab["id"]) for lab in labs])
    return full_issue(conn, r["full_name"], number)


def comment(conn: sqlite3.Connection, repo: str, number: int, body: str) -> Comment:
    """Comments on an issue as the logged-in user."""
    issue = _issue(conn, repo, number)
    with write(conn):
        now = _now(conn)
        cur = conn.execute(
            "INSERT INTO comments (issue_id, author_id, body, created_at) VALUES (?, ?, ?, ?)",
            (issue["id"], _me(conn), body, now),
        )
        conn.execute("UPDATE issues SET updated_at = ? WHERE id = ?", (now, issue["id"]))
    return Comment(id=int(cur.lastrowid or 0), author=meta(conn, "user_login"), body=body, created_at=now)


def label(conn: sqlite3.Connection, repo: str, number: int, labels: list[str]) -> IssueSummary:
    """Adds existing labels to an issue (those it has already are left as they are)."""
    issue = _issue(conn, repo, number)
    labs = _labels(conn, issue["repo_id"], issue["repo"], labels)
    with write(conn):
        conn.executemany("INSERT OR IGNORE INTO issue_labels VALUES (?, ?)", [(issue["id"], lab["id"]) for lab in labs])
        _touch(conn, issue["id"])
    return _summary(_issue(conn, repo, number))


def unlabel(conn: sqlite3.Connection, repo: str, number: int, name: str) -> IssueSummary:
    """Removes one label from an issue."""
    issue = _issue(conn, repo, number)
    lab = _labels(conn, issue["repo_id"], issue["repo"], [name])[0]
    with write(conn):
        cur = conn.execute("DELETE FROM issue_labels WHERE issue_id = ? AND label_id = ?", (issue["id"], lab["id"]))
        if cur.rowcount == 0:
            raise ToolError(f"{issue['repo']}#{number} does not have the label '{lab['name']}'")
        _touch(conn, issue["id"])
    return _summary(_issue(conn, repo, number))


def assign(conn: sqlite3.Connection, repo: str, number: int, assignee: str | None) -> IssueSummary:
    """Sets (or with None clears) an issue's assignee."""
    issue = _issue(conn, repo, number)
    assignee_id = _user(conn, assignee)["id"] if assignee else None
    if assignee_id == issue["assignee_id"]:
        who = f"assigned to {assignee}" if assignee else "unassigned"
        raise ToolError(f"{issue['repo']}#{number} is already {who}")
    with write(conn):
        conn.execute("UPDATE issues SET assignee_id = ? WHERE id = ?", (assignee_id, issue["id"]))
        _touch(conn, issue["id"])
    return _summary(_issue(conn, repo, number))


def close(
    conn: sqlite3.Connection, repo: str, number: int, reason: str = "completed", closing_comment: str | None = None
) -> Issue:
    """Closes an open issue with a reason ('completed' or 'not_planned'), optionally commenting first."""
    if reason not in ("completed", "not_planned"):
        raise ToolError(f"reason must be 'completed' or 'not_planned', not '{reason}'")
    with write(conn):  # the state check belongs to the same transaction as the change
        issue = _issue(conn, repo, number)
        if issue["state"] == "closed":
            raise ToolError(f"{issue['repo']}#{number} is already closed")
        now = _now(conn)
        if closing_comment:
            conn.execute(
                "INSERT INTO comments (issue_id, author_id, body, created_at) VALUES (?, ?, ?, ?)",
                (issue["id"], _me(conn), closing_comment, now),
            )
        conn.execute(
            "UPDATE issues SET state = 'closed', state_reason = ?, closed_at = ?, updated_at = ? WHERE id = ?",
            (reason, now, now, issue["id"]),
        )
    return full_issue(conn, repo, number)


def reopen(conn: sqlite3.Connection, repo: str, number: int) -> IssueSummary:
    """Reopens a closed issue."""
    with write(conn):
        issue = _issue(conn, repo, number)
        if issue["state"] == "open":
            raise ToolError(f"{issue['repo']}#{number} is already open")
        conn.execute(
            "UPDATE issues SET state = 'open', state_reason = NULL, closed_at = NULL WHERE id = ?", (issue["id"],)
        )
        _touch(conn, issue["id"])
    return _summary(_issue(conn, repo, number))


def label_list(conn: sqlite3.Connection, repo: str) -> LabelList:
    """A repository's labels with how many open issues carry each."""
    r = _repo(conn, repo)
    found = rows(
        conn,
        "SELECT l.name, l.color, l.description, (SELECT COUNT(*) FROM issue_labels il"
        " JOIN issues i ON i.id = il.issue_id WHERE il.label_id = l.id AND i.state = 'open')"
        " AS open_issues FROM labels l WHERE l.repo_id = ? ORDER BY l.name",
        (r["id"],),
    )
    return LabelList(repo=r["full_name"], labels=[Label(**x) for x in found])


def user_list(conn: sqlite3.Connection, query: str | None = None) -> UserList:
    """Users whose login or name contains `query` (everyone without one)."""
    pattern = like_pattern((query or "").strip())
    found = rows(
        conn,
        "SELECT login, name, role FROM users WHERE login LIKE ? ESCAPE '\\' OR name LIKE ? ESCAPE '\\' ORDER BY login",
        (pattern, pattern),
    )
    return UserList(users=[User(**u) for u in found])


def register_tools(server: Any) -> None:
    """Adds the tracker tools to an `MCPServer`."""
    read_only = ToolAnnotations(read_only_hint=True)

    @server.tool(annotations=read_only)
    def list_repos(ctx: Context) -> RepoList:
        """List the repositories you can see, with their open issue counts."""
        return repo_list(instance_db(ctx))

    @server.tool(annotations=read_only)
    def list_issues(
        ctx: Context,
        repo: RepoName,
        state: State = "open",
        label: Annotated[str | None, Field(max_length=50, description="Only issues with this label")] = None,
        assignee: Annotated[
            str | None,
            Field(max_length=64, description=("Only issues assigned to this login; 'none' for unassigned issues")),
        ] = None,
        author: Annotated[str | None, Field(max_length=64, description="Only issues opened by this login")] = None,
        limit: Limit = 30,
        offset: Offset = 0,
    ) -> IssuePage:
        """List a repository's issues, newest first, filtered by state, label, assignee or author."""
        return issue_page(
            instance_db(ctx), repo, state, label=label, assignee=assignee, author=author, limit=limit, offset=offset
        )

    @server.tool(annotations=read_only)
    def search_issues(
        ctx: Context,
        query: Annotated[
            str,
            Field(
                min_length=1,
                max_length=200,
                description=("Text to find in issue titles and bodies (case-insensitive substring)"),
            ),
        ],
        repo: Annotated[str | None, Field(max_length=100, description="Limit to one repository")] = None,
        state: State = "all",
        limit: Limit = 30,
        offset: Offset = 0,
    ) -> IssuePage:
        """Search issues by text across all repositories (or one), newest first."""
        return search(instance_db(ctx), query, repo, state, limit=limit, offset=offset)

    @server.tool(annotations=read_only)
    def get_issue(ctx: Context, repo: RepoName, number: IssueNumber) -> Issue:
        """Get one issue in full: body, labels, assignee, state and all comments."""
        return full_issue(instance_db(ctx), repo, number)

    @server.tool()
    def create_issue(
        ctx: Context,
        repo: RepoName,
        title: Title,
        body: Annotated[str, Field(max_length=20000, description="Markdown description")] = "",
        labels: Annotated[list[LabelName] | None, Field(max_length=10, description="Existing label names")] = None,
        assignee: Annotated[str | None, Field(max_length=64, description="Login to assign")] = None,
    ) -> Issue:
        """Open a new issue as the logged-in user, optionally labelled and assigned. Returns it with its number."""
        return create(instance_db(ctx), repo, title, body, labels, assignee)

    @server.tool()
    def add_comment(ctx: Context, repo: RepoName, number: IssueNumber, body: Body) -> Comment:
        """Comment on an issue as the logged-in user."""
        return comment(instance_db(ctx), repo, number, body)

    @server.tool()
    def add_labels(
        ctx: Context,
        repo: RepoName,
        number: IssueNumber,
        labels: Annotated[
            list[LabelName], Field(min_length=1, max_length=10, description=("Existing label names to add"))
        ],
    ) -> IssueSummary:
        """Add existing labels to an issue (labels it already has are left as they are)."""
        return label(instance_db(ctx), repo, number, labels)

    @server.tool()
    def remove_label(ctx: Context, repo: RepoName, number: IssueNumber, label: LabelName) -> IssueSummary:
        """Remove one label from an issue."""
        return unlabel(instance_db(ctx), repo, number, label)

    @server.tool()
    def assign_issue(
        ctx: Context,
        repo: RepoName,
        number: IssueNumber,
        assignee: Annotated[str | None, Field(max_length=64, description=("Login to assign; null to unassign"))],
    ) -> IssueSummary:
        """Set (or clear, with null) an issue's assignee. Only maintainers and members can be assigned."""
        return assign(instance_db(ctx), repo, number, assignee)

    @server.tool()
    def close_issue(
        ctx: Context,
        repo: RepoName,
        number: IssueNumber,
        reason: Annotated[
            Literal["completed", "not_planned"],
            Field(description=("'completed' when done or fixed; 'not_planned' for duplicates, won't-fix or invalid")),
        ] = "completed",
        comment: Annotated[str | None, Field(max_length=20000, description="Optional closing comment")] = None,
    ) -> Issue:
        """Close an open issue with a reason, optionally leaving a comment first."""
        return close(instance_db(ctx), repo, number, reason, comment)

    @server.tool()
    def reopen_issue(ctx: Context, repo: RepoName, number: IssueNumber) -> IssueSummary:
        """Reopen a closed issue."""
        return reopen(instance_db(ctx), repo, number)

    @server.tool(annotations=read_only)
    def list_labels(ctx: Context, repo: RepoName) -> LabelList:
        """List a repository's labels with how many open issues carry each."""
        return label_list(instance_db(ctx), repo)

    @server.tool(annotations=read_only)
    def list_users(
        ctx: Context,
        query: Annotated[
            str | None, Field(max_length=64, description=("Part of a login or name; omit to list everyone"))
        ] = None,
    ) -> UserList:
        """List users (logins, names, roles) who can be assigned or mentioned."""
        return user_list(instance_db(ctx), query)


SPEC = EnvironmentSpec(
    env_id="tracker",
    version="v1",
    name="Tracker",
    description="A GitHub-like issue tracker: repositories, issues, labels, comments, assignees, close/reopen.",
    schema_sql=SCHEMA,
    seed=seed,
    register_tools=register_tools,
    app=webui_routes("tracker"),
    env_variables={"LOGGED_IN_USER": USER_LOGIN, "APP_TODAY": TODAY},
    mcp_era="legacy",
)
