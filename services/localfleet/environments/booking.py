"""`booking:v1` — a travel booking site: search flights and hotels, hold an offer, book it for a traveller on
the profile with a saved card (optionally redeeming loyalty points), cancel, list bookings.

The logged-in user is Jamie Park. The app's 'today' is 2026-03-02; flights run 2026-03-03..2026-04-01.
Offer ids: flights `FL-<id>`, hotels `HT-<hotel id>-<check-in YYYYMMDD>-<check-out YYYYMMDD>`.
Loyalty: 1 point earned per whole dollar charged; 1 point redeems 1 cent.
"""

from __future__ import annotations

import random
import re
import sqlite3
from datetime import date, datetime, timedelta
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from rlgate.localfleet.environments._support import (
    app_clock,
    create_schema,
    meta,
    require,
    row,
    rows,
    scalar,
    webui_routes,
    write,
)
from rlgate.localfleet.environments.base import EnvironmentSpec, instance_db

USER_NAME = "Jamie Park"
USER_EMAIL = "jamie.park@example.com"
TODAY = "2026-03-02"
HOLD_MINUTES = 30

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS airports (code TEXT PRIMARY KEY, city TEXT NOT NULL, country TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS flights (
    id INTEGER PRIMARY KEY,
    flight_no TEXT NOT NULL,
    airline TEXT NOT NULL,
    origin TEXT NOT NULL REFERENCES airports(code),
    destination TEXT NOT NULL REFERENCES airports(code),
    depart_at TEXT NOT NULL,
    arrive_at TEXT NOT NULL,
    cabin TEXT NOT NULL CHECK (cabin IN ('economy', 'business')),
    price_cents INTEGER NOT NULL,
    seats_left INTEGER NOT NULL,
    refundable INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS hotels (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    city TEXT NOT NULL,
    stars INTEGER NOT NULL,
    rating REAL NOT NULL,
    nightly_cents INTEGER NOT NULL,
    rooms_left INTEGER NOT NULL,
    refundable INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS travellers (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    date_of_birth TEXT NOT NULL,
    relation TEXT NOT NULL,
    is_primary INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS payment_methods (
    id INTEGER PRIMARY KEY,
    brand TEXT NOT NULL,
    last4 TEXT NOT NULL,
    expires TEXT NOT NULL,
    is_default INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS holds (
    id INTEGER PRIMARY KEY,
    offer_id TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('flight', 'hotel')),
    flight_id INTEGER REFERENCES flights(id),
    hotel_id INTEGER REFERENCES hotels(id),
    check_in TEXT,
    check_out TEXT,
    passengers INTEGER NOT NULL,
    total_cents INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    expires_at TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('active', 'booked', 'released'))
);
CREATE TABLE IF NOT EXISTS bookings (
    id INTEGER PRIMARY KEY,
    confirmation TEXT NOT NULL UNIQUE,
    hold_id INTEGER REFERENCES holds(id),
    kind TEXT NOT NULL CHECK (kind IN ('flight', 'hotel')),
    flight_id INTEGER REFERENCES flights(id),
    hotel_id INTEGER REFERENCES hotels(id),
    check_in TEXT,
    check_out TEXT,
    passengers INTEGER NOT NULL,
    traveller_id INTEGER NOT NULL REFERENCES travellers(id),
    payment_method_id INTEGER NOT NULL REFERENCES payment_methods(id),
    total_cents INTEGER NOT NULL,
    points_redeemed INTEGER NOT NULL DEFAULT 0,
    charged_cents INTEGER NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('confirmed', 'cancelled')),
    refund_cents INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL,
    cancelled_at TEXT
);
CREATE TABLE IF NOT EXISTS loyalty_ledger (
    id INTEGER PRIMARY KEY,
    booking_id INTEGER REFERENCES bookings(id),
    points INTEGER NOT NULL,
    reason TEXT NOT NULL,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS flights_route ON flights(origin, destination, depart_at);
CREATE INDEX IF NOT EXISTS hotels_city ON hotels(city);
"""

_AIRPORTS = (
    ("SFO", "San Francisco", "US"),
    ("JFK", "New York", "US"),
    ("SEA", "Seattle", "US"),
    ("BOS", "Boston", "US"),
    ("ORD", "Chicago", "US"),
    ("LHR", "London", "GB"),
    ("CDG", "Paris", "FR"),
    ("LIS", "Lisbon", "PT"),
    ("BER", "Berlin", "DE"),
    ("NRT", "Tokyo", "JP"),
    ("YYZ", "Toronto", "CA"),
    ("MAD", "Madrid", "ES"),
)
# (origin, destination, hours, base economy price in dollars, daily probability)
_ROUTES = (
    ("SFO", "JFK", 5.5, 260, 1.0),
    ("JFK", "SFO", 6.3, 270, 1.0),
    ("SEA", "BOS", 5.4, 240, 0.7),
    ("BOS", "SEA", 6.2, 250, 0.7),
    ("ORD", "LHR", 8.0, 520, 0.6),
    ("LHR", "ORD", 9.0, 540, 0.6),
    ("JFK", "LHR", 7.0, 480, 0.9),
    ("LHR", "JFK", 8.0, 490, 0.9),
    ("LHR", "CDG", 1.3, 110, 0.8),
    ("CDG", "LIS", 2.5, 130, 0.6),
    ("LIS", "BER", 3.5, 150, 0.5),
    ("SFO", "NRT", 11.0, 820, 0.5),
    ("NRT", "SFO", 9.5, 800, 0.5),
    ("YYZ", "MAD", 7.5, 560, 0.4),
    ("MAD", "YYZ", 8.5, 570, 0.4),
    ("SEA", "SFO", 2.2, 120, 0.8),
)
_AIRLINES = (
    ("UA", "United"),
    ("DL", "Delta"),
    ("BA", "British Airways"),
    ("AF", "Air France"),
    ("TP", "TAP Air Portugal"),
    ("NH", "ANA"),
    ("AC", "Air Canada"),
    ("IB", "Iberia"),
)
_HOTEL_WORDS = (
    ("Grand", "Harbor", "Central", "Garden", "Riverside", "Plaza"),
    ("Hotel", "Suites", "Inn", "Residences", "Lodge"),
)


def _money(cents: int) -> float:
    return round(cents / 100, 2)


def seed(conn: sqlite3.Connection) -> None:
    """Deterministic: 12 airports, ~600 flight fares, 60 hotels, a profile, ~25 past bookings."""
    create_schema(conn, SCHEMA)
    rng = random.Random(777)
    conn.executemany(
        "INSERT INTO meta VALUES (?, ?)", [("today", TODAY), ("user_name", USER_NAME), ("user_email", USER_EMAIL)]
    )
    conn.executemany("INSERT INTO airports VALUES (?, ?, ?)", _AIRPORTS)
    today = date.fromisoformat(TODAY)
    fares: list[tuple[Any, ...]] = []
    for day in range(1, 31):
        d = today + timedelta(days=day)
        for origin, dest, hours, base, prob in _ROUTES:
            if rng.random() > prob:
                continue
            for _ in range(2 if prob == 1.0 else rng.choice((1, 1, 2))):
                code, _airline = rng.choice(_AIRLINES)
                depart = datetime(d.year, d.month, d.day, rng.randint(6, 21), rng.choice((0, 15, 30, 45)))
                arrive = depart + timedelta(hours=hours)
                number = f"{code}{rng.randint(100, 2999)}"
                econ = int(base * rng.uniform(0.75, 1.45)) * 100
                for cabin, price in (("economy", econ), ("business", int(econ * rng.uniform(2.6, 3.4)) // 100 * 100)):
                    fares.append(
                        (
                            number,
                            dict(_AIRLINES)[code],
                            origin,
                            dest,
                            depart.strftime("%Y-%m-%dT%H:%M"),
                            arrive.strftime("%Y-%m-%dT%H:%M"),
                            cabin,
                            price,
                            rng.choice((0, 1, 2, 4, 7, 9, 12, 20)),
                            int(cabin == "business" or rng.random() < 0.3),
                        )
                    )
    fares.sort(key=lambda f: (f[4], f[0], f[6]))
    conn.executemany(
        "INSERT INTO flights (flight_no, airline, origin, destination, depart_at, arrive_at, cabin,"
        " price_cents, seats_left, refundable) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        fares,
    )
    used: set[str] = set()
    for _code, city, _country in _AIRPORTS[:10]:
        for _ in range(6):
            name = f"{rng.choice(_HOTEL_WORDS[0])} {city} {rng.choice(_HOTEL_WORDS[1])}"
            while name in used:
                name = f"{rng.choice(_HOTEL_WORDS[0])} {city} {rng.choice(_HOTEL_WORDS[1])}"
            used.add(name)
            stars = rng.choice((2, 3, 3, 4, 4, 5))
            conn.execute(
                "INSERT INTO hotels (name, city, stars, rating, nightly_cents, rooms_left, refundable)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    name,
                    city,
                    stars,
                    round(rng.uniform(6.5, 9.7), 1),
                    (60 + stars * 45 + rng.randint(0, 80)) * 100,
                    rng.choice((0, 2, 5, 8, 15)),
                    int(rng.random() < 0.6),
                ),
            )
    conn.executemany(
        "INSERT INTO travellers VALUES (?, ?, ?, ?, ?)",
        [
            (1, USER_NAME, "1988-07-14", "self", 1),
            (2, "Robin Park", "1990-02-03", "partner", 0),
            (3, "Casey Park", "2016-11-21", "child", 0),
            (4, "Morgan Lee", "1961-05-30", "parent", 0),
        ],
    )
    conn.executemany(
        "INSERT INTO payment_methods VALUES (?, ?, ?, ?, ?)",
        [(1, "Visa", "4242", "2028-09", 1), (2, "Mastercard", "5454", "2027-01", 0), (3, "Amex", "1005", "2025-12", 0)],
    )
    # Past trips: confirmed and cancelled bookings of flights that already left are not in `flights`, so the
    # history refers to hotels only (flights table holds the searchable future schedule).
    ledger: list[tuple[Any, ...]] = [(None, 12000, "Welcome bonus", "2025-01-05T10:00")]
    n_hotels = int(scalar(conn, "SELECT COUNT(*) FROM hotels"))
    for i in range(1, 26):
        hotel = row(conn, "SELECT * FROM hotels WHERE id = ?", (rng.randint(1, n_hotels),))
        assert hotel is not None
        check_in = today - timedelta(days=rng.randint(20, 400))
        nights = rng.randint(1, 5)
        total = hotel["nightly_cents"] * nights
        cancelled = rng.random() < 0.2
        created = datetime.combine(check_in - timedelta(days=rng.randint(5, 40)), datetime.min.time()).replace(hour=12)
        conn.execute(
            "INSERT INTO bookings (id, confirmation, kind, hotel_id, check_in, check_out, passengers, traveller_id,"
            " payment_method_id, total_cents, charged_cents, status, refund_cents, created_at, cancelled_at)"
            " VALUES (?, ?, 'hotel', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                i,
                f"PK{rng.randint(100000, 999999)}",
                hotel["id"],
                check_in.isoformat(),
                (check_in + timedelta(days=nights)).isoformat(),
                rng.choice((1, 1, 2)),
                rng.choice((1, 1, 1, 2, 4)),
                rng.choice((1, 1, 2)),
                total,
                total,
                "cancelled" if cancelled else "confirmed",
                total if cancelled else 0,
                created.strftime("%Y-%m-%dT%H:%M"),
                (created + timedelta(days=2)).strftime("%Y-%m-%dT%H:%M") if cancelled else None,
            ),
        )
        if not cancelled:
            ledger.append((i, total // 100, "Earned on booking", created.strftime("%Y-%m-%dT%H:%M")))
    ledger.append((None, -5000, "Redeemed for gift card", "2025-11-20T18:30"))
    # Three upcoming trips, so there is something to change or cancel.
    upcoming = (
        (
            "flight",
            "SELECT * FROM flights WHERE origin = 'SFO' AND destination = 'JFK' AND cabin = 'economy'"
            " AND refundable = 1 AND depart_at >= '2026-03-12' ORDER BY depart_at, id LIMIT 1",
            None,
            None,
            1,
            1,
            0,
            "2026-02-20T10:15",
        ),
        (
            "hotel",
            "SELECT * FROM hotels WHERE city = 'Paris' AND refundable = 1 ORDER BY nightly_cents, id LIMIT 1",
            "2026-03-18",
            "2026-03-21",
            2,
            2,
            2000,
            "2026-02-25T19:40",
        ),
        (
            "hotel",
            "SELECT * FROM hotels WHERE city = 'Tokyo' AND refundable = 0 ORDER BY nightly_cents, id LIMIT 1",
            "2026-03-25",
            "2026-03-28",
            1,
            1,
            0,
            "2026-02-27T08:05",
        ),
    )
    for i, (kind, sql, check_in_s, check_out_s, guests, card, points, created_s) in enumerate(upcoming, start=26):
        item = row(conn, sql)
        assert item is not None
        if kind == "flight":
            total = item["price_cents"] * guests
        else:
            total = (
                item["nightly_cents"]
                * (date.fromisoformat(check_out_s or "") - date.fromisoformat(check_in_s or "")).days
            )
        conn.execute(
            "INSERT INTO bookings (id, confirmation, kind, flight_id, hotel_id, check_in, check_out, passengers,"
            " traveller_id, payment_method_id, total_cents, points_redeemed, charged_cents, status, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?, 'confirmed', ?)",
            (
                i,
                f"PK{rng.randint(100000, 999999)}",
                kind,
                item["id"] if kind == "flight" else None,
                item["id"] if kind == "hotel" else None,
                check_in_s,
                check_out_s,
                guests,
                card,
                total,
                points,
                total - points,
                created_s,
            ),
        )
        if points:
            ledger.append((i, -points, "Redeemed on booking", created_s))
        ledger.append((i, (total - points) // 100, "Earned on booking", created_s))
    conn.executemany("INSERT INTO loyalty_ledger (booking_id, points, reason, created_at) VALUES (?, ?, ?, ?)", ledger)
    conn.commit()


# --- tool results ---


class FlightOffer(BaseModel):
    offer_id: str
    flight_no: str
    airline: str
    origin: str
    destination: str
    depart_at: str = Field(description="Local departure time, ISO 8601")
    arrive_at: str
    cabin: Literal["economy", "business"]
    price_usd: float = Field(description="Per passenger")
    seats_left: int
    refundable: bool


class FlightResults(BaseModel):
    offers: list[FlightOffer]


class HotelOffer(BaseModel):
    offer_id: str
    hotel: str
    city: str
    stars: int
    rating: float
    check_in: str
    check_out: str
    nights: int
    nightly_usd: float
    total_usd: float = Field(description="For the whole stay, one room")
    rooms_left: int
    refundable: bool


class HotelResults(BaseModel):
    offers: list[HotelOffer]


class Offer(BaseModel):
    kind: Literal["flight", "hotel"]
    flight: FlightOffer | None = None
    hotel: HotelOffer | None = None


class Hold(BaseModel):
    hold_id: int
    offer_id: str
    kind: Literal["flight", "hotel"]
    passengers: int
    total_usd: float
    expires_at: str
    status: Literal["active", "booked", "released"]


class Booking(BaseModel):
    confirmation: str
    kind: Literal["flight", "hotel"]
    status: Literal["confirmed", "cancelled"]
    description: str
    start: str = Field(description="Departure time or check-in date")
    end: str = Field(description="Arrival time or check-out date")
    passengers: int
    traveller: str
    payment: str
    total_usd: float
    points_redeemed: int
    charged_usd: float
    refund_usd: float
    refundable: bool


class BookingList(BaseModel):
    bookings: list[Booking]


class Traveller(BaseModel):
    id: int
    name: str
    date_of_birth: str
    relation: str
    is_primary: bool


class PaymentMethod(BaseModel):
    id: int
    brand: str
    last4: str
    expires: str = Field(description="YYYY-MM; a card is usable through the end of that month")
    is_default: bool


class Profile(BaseModel):
    name: str
    email: str
    travellers: list[Traveller]
    payment_methods: list[PaymentMethod]
    loyalty_points: int


class LedgerEntry(BaseModel):
    points: int
    reason: str
    created_at: str
    confirmation: str | None


class Loyalty(BaseModel):
    balance: int = Field(description="Points; 1 point = 1 cent when redeemed")
    history: list[LedgerEntry] = Field(description="Most recent first (at most 20)")


Airport = Annotated[str, Field(pattern=r"^[A-Za-z]{3}$", description="IATA airport code, e.g. 'SFO'")]
Day = Annotated[str, Field(pattern=r"^\d{4}-\d{2}-\d{2}$", description="Date, YYYY-MM-DD")]
OfferId = Annotated[
    str,
    Field(
        min_length=4,
        max_length=40,
        description=("Offer id from a search: 'FL-<n>' for flights, 'HT-<n>-<YYYYMMDD>-<YYYYMMDD>' for hotel stays"),
    ),
]
City = Annotated[str, Field(min_length=2, max_length=60, description="City name, e.g. 'Lisbon'")]
Passengers = Annotated[int, Field(ge=1, le=6, description="Seats for a flight, or guests in one room for a hotel")]
Points = Annotated[
    int, Field(ge=0, description="Loyalty points to spend (1 point = 1 cent off); the rest is charged to the card")
]
Confirmation = Annotated[str, Field(min_length=4, max_length=12, description="Booking confirmation code")]
Limit = Annotated[int, Field(ge=1, le=50, description="Maximum results (1-50)")]

# ids of at most 12 digits: a longer one names nothing (and would overflow SQLite's integers)
_HOTEL_OFFER = re.compile(r"^HT-(\d{1,12})-(\d{8})-(\d{8})$")
_FLIGHT_OFFER = re.compile(r"^FL-(\d{1,12})$")
_BOOKING_SQL = (
    "SELECT b.*, t.name AS traveller, p.brand || ' ending ' || p.last4 AS payment,"
    " f.flight_no, f.origin, f.destination, f.depart_at, f.arrive_at, f.cabin, f.refundable AS f_refundable,"
    " h.name AS hotel_name, h.city, h.refundable AS h_refundable"
    " FROM bookings b JOIN travellers t ON t.id = b.traveller_id JOIN payment_methods p ON p.id = b.payment_method_id"
    " LEFT JOIN flights f ON f.id = b.flight_id LEFT JOIN hotels h ON h.id = b.hotel_id"
)


def _flight_offer(r: dict[str, Any]) -> FlightOffer:
    return FlightOffer(
        offer_id=f"FL-{r['id']}",
        flight_no=r["flight_no"],
        airline=r["airline"],
        origin=r["origin"],
        destination=r["destination"],
        depart_at=r["depart_at"],
        arrive_at=r["arrive_at"],
        cabin=r["cabin"],
        price_usd=_money(r["price_cents"]),
        seats_left=r["seats_left"],
        refundable=bool(r["refundable"]),
    )


def _hotel_offer(r: dict[str, Any], check_in: date, check_out: date) -> HotelOffer:
    nights = (check_out - check_in).days
    return HotelOffer(
        offer_id=f"HT-{r['id']}-{check_in:%Y%m%d}-{check_out:%Y%m%d}",
        hotel=r["name"],
        city=r["city"],
        stars=r["stars"],
        rating=r["rating"],
        check_in=check_in.isoformat(),
        check_out=check_out.isoformat(),
        nights=nights,
        nightly_usd=_money(r["nightly_cents"]),
        total_usd=_money(r["nightly_cents"] * nights),
        rooms_left=r["rooms_left"],
        refundable=bool(r["refundable"]),
    )


def _booking(r: dict[str, Any]) -> Booking:
    if r["kind"] == "flight":
        desc = f"{r['flight_no']} {r['origin']}->{r['destination']} ({r['cabin']})"
        start, end, refundable = r["depart_at"], r["arrive_at"], r["f_refundable"]
    else:
        desc = f"{r['hotel_name']}, {r['city']}"
        start, end, refundable = r["check_in"], r["check_out"], r["h_refundable"]
    return Booking(
        confirmation=r["confirmation"],
        kind=r["kind"],
        status=r["status"],
        description=desc,
        start=start,
        end=end,
        passengers=r["passengers"],
        traveller=r["traveller"],
        payment=r["payment"],
        total_usd=_money(r["total_cents"]),
        points_redeemed=r["points_redeemed"],
        charged_usd=_money(r["charged_cents"]),
        refund_usd=_money(r["refund_cents"]),
        refundable=bool(refundable),
    )


def _parse_day(value: str, what: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise ToolError(f"{what} '{value}' is not a valid date (YYYY-MM-DD)") from None


def _stay(check_in: date, check_out: date, today: date) -> None:
    if check_in <= today:
        raise ToolError(f"check-in must be after today ({today.isoformat()})")
    nights = (check_out - check_in).days
    if not 1 <= nights <= 30:
        raise ToolError("check-out must be 1 to 30 nights after check-in")


def _today(conn: sqlite3.Connection) -> date:
    return date.fromisoformat(meta(conn, "today"))


def _now(conn: sqlite3.Connection) -> str:
    return app_clock(
        conn,
        "SELECT MAX(m) FROM (SELECT MAX(created_at) AS m FROM holds"
        " UNION ALL SELECT MAX(created_at) FROM bookings"
        " UNION ALL SELECT MAX(cancelled_at) FROM bookings"
        " UNION ALL SELECT MAX(created_at) FROM loyalty_ledger)",
    )[:16]


def _balance(conn: sqlite3.Connection) -> int:
    return int(scalar(conn, "SELECT COALESCE(SUM(points), 0) FROM loyalty_ledger"))


def _offer(conn: sqlite3.Connection, offer_id: str) -> Offer:
    offer_id = offer_id.strip().upper()
    if m := _FLIGHT_OFFER.match(offer_id):
        r = require(conn, "SELECT * FROM flights WHERE id = ?", (int(m.group(1)),), f"no flight offer {offer_id}")
        return Offer(kind="flight", flight=_flight_offer(r))
    if m := _HOTEL_OFFER.match(offer_id):
        r = require(conn, "SELECT * FROM hotels WHERE id = ?", (int(m.group(1)),), f"no hotel in offer {offer_id}")
        try:
            check_in = datetime.strptime(m.group(2), "%Y%m%d").date()
            check_out = datetime.strptime(m.group(3), "%Y%m%d").date()
        except ValueError:
            raise ToolError(f"offer {offer_id} has an invalid date") from None
        _stay(check_in, check_out, _today(conn))
        return Offer(kind="hotel", hotel=_hotel_offer(r, check_in, check_out))
    raise ToolError(f"'{offer_id}' is not an offer id; use the offer_id from search_flights or search_hotels")


def _hold(r: dict[str, Any]) -> Hold:
    return Hold(
        hold_id=r["id"],
        offer_id=r["offer_id"],
        kind=r["kind"],
        passengers=r["passengers"],
        total_usd=_money(r["total_cents"]),
        expires_at=r["expires_at"],
        status=r["status"],
    )


def _book_hold(
    conn: sqlite3.Connection, hold_id: int, traveller_id: int, payment_method_id: int, points_to_redeem: int
) -> int:
    """Checks and books a hold (inside the caller's write transaction); returns the new booking id."""
    hold = require(conn, "SELECT * FROM holds WHERE id = ?", (hold_id,), f"no hold {hold_id}")
    if hold["status"] != "active":
        raise ToolError(f"hold {hold_id} is {hold['status']}; hold the offer again")
    now = _now(conn)
    if now > hold["expires_at"]:
        raise ToolError(f"hold {hold_id} expired at {hold['expires_at']}; hold the offer again")
    require(
        conn,
        "SELECT id FROM travellers WHERE id = ?",
        (traveller_id,),
        f"no traveller {traveller_id} on the profile; see get_profile",
    )
    card = require(
        conn,
        "SELECT * FROM payment_methods WHERE id = ?",
        (payment_method_id,),
        f"no payment method {payment_method_id}; see get_profile",
    )
    if card["expires"] < meta(conn, "today")[:7]:
        raise ToolError(f"the {card['brand']} ending {card['last4']} expired in {card['expires']}; use another card")
    balance = _balance(conn)
    if points_to_redeem > balance:
        raise ToolError(f"only {balance} points available")
    if points_to_redeem > hold["total_cents"]:
        raise ToolError(f"at most {hold['total_cents']} points can be redeemed on this booking")
    charged = hold["total_cents"] - points_to_redeem
    booking_id = int(scalar(conn, "SELECT COALESCE(MAX(id), 0) + 1 FROM bookings"))
    confirmation = f"PK{(booking_id * 7919 + 104729) % 900000 + 100000}"
    while scalar(conn, "SELECT 1 FROM bookings WHERE confirmation = ?", (confirmation,)):
        confirmation = f"PK{(int(confirmation[2:]) + 7919 - 100000) % 900000 + 100000}"
    conn.execute(
        "INSERT INTO bookings (id, confirmation, hold_id, kind, flight_id, hotel_id, check_in, check_out,"
        " passengers, traveller_id, payment_method_id, total_cents, points_redeemed, charged_cents, status,"
        " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'confirmed', ?)",
        (
            booking_id,
            confirmation,
            hold_id,
            hold["kind"],
            hold["flight_id"],
            hold["hotel_id"],
            hold["check_in"],
            hold["check_out"],
            hold["passengers"],
            traveller_id,
            payment_method_id,
            hold["total_cents"],
            points_to_redeem,
            charged,
            now,
        ),
    )
    conn.execute("UPDATE holds SET status = 'booked' WHERE id = ?", (hold_id,))
    if hold["kind"] == "flight":
        conn.execute(
            "UPDATE flights SET seats_left = seats_left - ? WHERE id = ?", (hold["passengers"], hold["flight_id"])
        )
    else:
        conn.execute("UPDATE hotels SET rooms_left = rooms_left - 1 WHERE id = ?", (hold["hotel_id"],))
    if points_to_redeem:
        conn.execute(
            "INSERT INTO loyalty_ledger (booking_id, points, reason, created_at) VALUES (?, ?, ?, ?)",
            (booking_id, -points_to_redeem, "Redeemed on booking", now),
        )
    if charged >= 100:
        conn.execute(
            "INSERT INTO loyalty_ledger (booking_id, points, reason, created_at) VALUES (?, ?, ?, ?)",
            (booking_id, charged // 100, "Earned on booking", now),
        )
    return booking_id


def _cancel(conn: sqlite3.Connection, confirmation: str) -> int:
    """Checks and cancels a booking (inside the caller's write transaction); returns its id."""
    b = require(
        conn,
        _BOOKING_SQL + " WHERE b.confirmation = ?",
        (confirmation.strip().upper(),),
        f"no booking with confirmation {confirmation}",
    )
    if b["status"] == "cancelled":
        raise ToolError(f"booking {b['confirmation']} is already cancelled")
    start = b["depart_at"] if b["kind"] == "flight" else b["check_in"]
    if start[:10] <= meta(conn, "today"):
        raise ToolError(f"booking {b['confirmation']} has already started or taken place; it cannot be cancelled")
    refundable = bool(b["f_refundable"] if b["kind"] == "flight" else b["h_refundable"])
    now = _now(conn)
    conn.execute(
        "UPDATE bookings SET status = 'cancelled', cancelled_at = ?, refund_cents = ? WHERE id = ?",
        (now, b["charged_cents"] if refundable else 0, b["id"]),
    )
    earned = int(
        scalar(
            conn, "SELECT COALESCE(SUM(points), 0) FROM loyalty_ledger WHERE booking_id = ? AND points > 0", (b["id"],)
        )
    )
    if earned:
        conn.execute(
            "INSERT INTO loyalty_ledger (booking_id, points, reason, created_at) VALUES (?, ?, ?, ?)",
            (b["id"], -earned, "Reversed on cancellation", now),
        )
    if refundable and b["points_redeemed"]:
        conn.execute(
            "INSERT INTO loyalty_ledger (booking_id, points, reason, created_at) VALUES (?, ?, ?, ?)",
            (b["id"], b["points_redeemed"], "Returned on cancellation", now),
        )
    if b["kind"] == "flight":
        conn.execute("UPDATE flights SET seats_left = seats_left + ? WHERE id = ?", (b["passengers"], b["flight_id"]))
    else:
        conn.execute("UPDATE hotels SET rooms_left = rooms_left + 1 WHERE id = ?", (b["hotel_id"],))
    return int(b["id"])


# --- operations: the one code path of the MCP tools and the web UI (services/localfleet/webui/booking.py) ---
# Each takes the instance's connection and raises ToolError with a message fit for the model or the page.


def flights(
    conn: sqlite3.Connection,
    origin: str,
    destination: str,
    day: str,
    *,
    cabin: str | None = None,
    max_price_usd: int | None = None,
    sort: str = "price",
    limit: int = 20,
) -> FlightResults:
    """Fares between two airports on one day (sold-out ones included), cheapest or earliest first."""
    when = _parse_day(day, "date")
    if when <= _today(conn):
        raise ToolError(f"date must be after today ({_today(conn).isoformat()})")
    for code in (origin, destination):
        _require_known(
            conn, "airports", "code = ?", code.strip().upper(), "code", f"unknown airport '{code}'; airports served"
        )
    required = [
        ("origin = ?", origin.strip().upper()),
        ("destination = ?", destination.strip().upper()),
        ("depart_at >= ?", when.isoformat()),
        ("depart_at < ?", (when + timedelta(days=1)).isoformat()),
    ]
    optional = [("cabin = ?", cabin), ("price_cents <= ?", (max_price_usd or 0) * 100)]
    order = "price_cents, depart_at, id" if sort == "price" else "depart_at, price_cents, id"
    found = _search(conn, "flights", required, optional, order, limit)
    return FlightResults(offers=[_flight_offer(r) for r in found])


def hotels(
    conn: sqlite3.Connection,
    city: str,
    check_in: str,
    check_out: str,
    *,
    min_stars: int | None = None,
    max_nightly_usd: int | None = None,
    limit: int = 20,
) -> HotelResults:
    """Hotels in a city for a stay, cheapest first; each offer id encodes the dates."""
    ci, co = _parse_day(check_in, "check_in"), _parse_day(check_out, "check_out")
    _stay(ci, co, _today(conn))
    _require_known(conn, "hotels", "city = ? COLLATE NOCASE", city.strip(), "city", f"no hotels in '{city}'; cities")
    required = [("city = ? COLLATE NOCASE", city.strip())]
    optional = [("stars >= ?", min_stars), ("nightly_cents <= ?", (max_nightly_usd or 0) * 100)]
    found = _search(conn, "hotels", required, optional, "nightly_cents, id", limit)
    return HotelResults(offers=[_hotel_offer(r, ci, co) for r in found])


def _require_known(conn: sqlite3.Connection, table: str, match: str, value: str, column: str, error: str) -> None:
    """ToolError `error: <every distinct column value>` unless a row of `table` meets `match` for `value`."""
    if scalar(conn, f"SELECT 1 FROM {table} WHERE {match}", (value,)) is None:
        known = ", ".join(r[column] for r in rows(conn, f"SELECT DISTINCT {column} FROM {table} ORDER BY {column}"))
        raise ToolError(f"{error}: {known}")


def _search(
    conn: sqlite3.Connection,
    table: str,
    required: list[tuple[str, Any]],
    optional: list[tuple[str, Any]],
    order: str,
    limit: int,
) -> list[dict[str, Any]]:
    """Rows of `table` meeting every `required` condition and each `optional` one whose value is set (a falsy
    value, None or 0, means any), in `order`, at most `limit`."""
    conditions = [*required, *((clause, value) for clause, value in optional if value)]
    where = " AND ".join(clause for clause, _ in conditions)
    params = [value for _, value in conditions]
    return rows(conn, f"SELECT * FROM {table} WHERE {where} ORDER BY {order} LIMIT ?", [*params, limit])


def offer(conn: sqlite3.Connection, offer_id: str) -> Offer:
    """The current details, price and availability of one offer."""
    return _offer(conn, offer_id)


def hold(conn: sqlite3.Connection, offer_id: str, passengers: int = 1) -> Hold:
    """Holds an offer's price and availability for HOLD_MINUTES."""
    found = _offer(conn, offer_id)
    if found.flight is not None:
        if found.flight.seats_left < passengers:
            raise ToolError(
                f"only {found.flight.seats_left} seat(s) left on {found.flight.flight_no} in "
                f"{found.flight.cabin}; choose another flight or fewer passengers"
            )
        total = round(found.flight.price_usd * 100) * passengers
        offer_key = found.flight.offer_id
        fid, hid, ci, co = int(offer_key[3:]), None, None, None
    else:
        assert found.hotel is not None
        if found.hotel.rooms_left < 1:
            raise ToolError(f"{found.hotel.hotel} has no rooms left")
        if passengers > 4:
            raise ToolError("a hotel room holds at most 4 guests")
        total = round(found.hotel.total_usd * 100)
        offer_key = found.hotel.offer_id
        fid, hid = None, int(offer_key.split("-")[1])
        ci, co = found.hotel.check_in, found.hotel.check_out
    with write(conn):
        now = _now(conn)
        expires = (datetime.fromisoformat(now) + timedelta(minutes=HOLD_MINUTES)).strftime("%Y-%m-%dT%H:%M")
        cur = conn.execute(
            "INSERT INTO holds (offer_id, kind, flight_id, hotel_id, check_in, check_out, passengers,"
            " total_cents, created_at, expires_at, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'active')",
            (offer_key, found.kind, fid, hid, ci, co, passengers, total, now, expires),
        )
    return _hold(require(conn, "SELECT * FROM holds WHERE id = ?", (cur.lastrowid,), "hold vanished"))


def release(conn: sqlite3.Connection, hold_id: int) -> Hold:
    """Releases an active hold."""
    found = require(conn, "SELECT * FROM holds WHERE id = ?", (hold_id,), f"no hold {hold_id}")
    if found["status"] != "active":
        raise ToolError(f"hold {hold_id} is {found['status']}, not active")
    with write(conn):
        conn.execute("UPDATE holds SET status = 'released' WHERE id = ?", (hold_id,))
    return _hold({**found, "status": "released"})


def book(
    conn: sqlite3.Connection, hold_id: int, traveller_id: int, payment_method_id: int, points_to_redeem: int = 0
) -> Booking:
    """Books a held offer for a traveller with a saved card (and optionally points); returns the booking."""
    with write(conn):
        booking_id = _book_hold(conn, hold_id, traveller_id, payment_method_id, points_to_redeem)
    return _booking(require(conn, _BOOKING_SQL + " WHERE b.id = ?", (booking_id,), "booking vanished"))


def cancel(conn: sqlite3.Connection, confirmation: str) -> Booking:
    """Cancels a confirmed upcoming booking (refunds and points as its fare allows); returns it."""
    with write(conn):
        booking_id = _cancel(conn, confirmation)
    return _booking(require(conn, _BOOKING_SQL + " WHERE b.id = ?", (booking_id,), "booking vanished"))


def booking_list(conn: sqlite3.Connection, status: str = "all", *, upcoming_only: bool = False) -> BookingList:
    """The bookings, most recent first."""
    clauses: list[str] = ["1 = 1"]
    params: list[Any] = []
    if status != "all":
        clauses.append("b.status = ?")
        params.append(status)
    if upcoming_only:
        clauses.append("COALESCE(f.depart_at, b.check_in) > ?")
        params.append(meta(conn, "today") + "T23:59")
    found = rows(conn, _BOOKING_SQL + f" WHERE {' AND '.join(clauses)} ORDER BY b.created_at DESC, b.id DESC", params)
    return BookingList(bookings=[_booking(r) for r in found])


def booking(conn: sqlite3.Connection, confirmation: str) -> Booking:
    """One booking by its confirmation code."""
    code = confirmation.strip().upper()
    return _booking(require(conn, _BOOKING_SQL + " WHERE b.confirmation = ?", (code,), f"no booking {code}"))


def profile(conn: sqlite3.Connection) -> Profile:
    """The profile: travellers, saved cards and loyalty balance."""
    return Profile(
        name=meta(conn, "user_name"),
        email=meta(conn, "user_email"),
        travellers=[
            Traveller(**{**t, "is_primary": bool(t["is_primary"])})
            for t in rows(conn, "SELECT * FROM travellers ORDER BY id")
        ],
        payment_methods=[
            PaymentMethod(**{**p, "is_default": bool(p["is_default"])})
            for p in rows(conn, "SELECT * FROM payment_methods ORDER BY id")
        ],
        loyalty_points=_balance(conn),
    )


def loyalty(conn: sqlite3.Connection) -> Loyalty:
    """The points balance and the 20 most recent movements."""
    history = rows(
        conn,
        "SELECT l.points, l.reason, l.created_at, b.confirmation FROM loyalty_ledger l"
        " LEFT JOIN bookings b ON b.id = l.booking_id ORDER BY l.created_at DESC, l.id DESC"
        " LIMIT 20",
    )
    return Loyalty(balance=_balance(conn), history=[LedgerEntry(**h) for h in history])


def register_tools(server: Any) -> None:
    """Adds the booking tools to an `MCPServer`."""
    read_only = ToolAnnotations(read_only_hint=True)

    @server.tool(annotations=read_only)
    def search_flights(
        ctx: Context,
        origin: Airport,
        destination: Airport,
        date: Day,
        cabin: Annotated[Literal["economy", "business"] | None, Field(description="Only this cabin")] = None,
        max_price_usd: Annotated[int | None, Field(ge=1, description="Highest price per passenger, USD")] = None,
        sort: Annotated[
            Literal["price", "departure"], Field(description="Cheapest first, or earliest first")
        ] = "price",
        limit: Limit = 20,
    ) -> FlightResults:
        """Search flights between two airports on one day. Results include sold-out fares (seats_left 0)."""
        return flights(
            instance_db(ctx),
            origin,
            destination,
            date,
            cabin=cabin,
            max_price_usd=max_price_usd,
            sort=sort,
            limit=limit,
        )

    @server.tool(annotations=read_only)
    def search_hotels(
        ctx: Context,
        city: City,
        check_in: Day,
        check_out: Day,
        min_stars: Annotated[int | None, Field(ge=1, le=5, description="Lowest star rating")] = None,
        max_nightly_usd: Annotated[int | None, Field(ge=1, description="Highest nightly rate, USD")] = None,
        limit: Limit = 20,
    ) -> HotelResults:
        """Search hotels in a city for a stay, cheapest first. Each result's offer_id encodes the dates."""
        return hotels(
            instance_db(ctx),
            city,
            check_in,
            check_out,
            min_stars=min_stars,
            max_nightly_usd=max_nightly_usd,
            limit=limit,
        )

    @server.tool(annotations=read_only)
    def get_offer(ctx: Context, offer_id: OfferId) -> Offer:
        """Get the current details, price and availability of one flight or hotel offer."""
        return offer(instance_db(ctx), offer_id)

    @server.tool()
    def hold_offer(ctx: Context, offer_id: OfferId, passengers: Passengers = 1) -> Hold:
        """Hold an offer's price and availability for 30 minutes; book it with book_hold."""
        return hold(instance_db(ctx), offer_id, passengers)

    @server.tool()
    def release_hold(ctx: Context, hold_id: Annotated[int, Field(ge=1, description="From hold_offer")]) -> Hold:
        """Release an active hold you no longer want."""
        return release(instance_db(ctx), hold_id)

    @server.tool()
    def book_hold(
        ctx: Context,
        hold_id: Annotated[int, Field(ge=1, description="From hold_offer")],
        traveller_id: Annotated[int, Field(ge=1, description="Lead traveller, from get_profile")],
        payment_method_id: Annotated[int, Field(ge=1, description="Saved card, from get_profile")],
        points_to_redeem: Points = 0,
    ) -> Booking:
        """Book a held offer for a traveller on the profile, paying with a saved card and optionally points.

        Earns 1 loyalty point per whole dollar charged to the card. Returns the confirmed booking.
        """
        return book(instance_db(ctx), hold_id, traveller_id, payment_method_id, points_to_redeem)

    @server.tool(annotations=ToolAnnotations(destructive_hint=True))
    def cancel_booking(ctx: Context, confirmation: Confirmation) -> Booking:
        """Cancel a confirmed upcoming booking. Refundable fares refund the card charge and return redeemed
        points; non-refundable fares refund nothing. Points earned on the booking are taken back."""
        return cancel(instance_db(ctx), confirmation)

    @server.tool(annotations=read_only)
    def list_bookings(
        ctx: Context,
        status: Annotated[
            Literal["confirmed", "cancelled", "all"], Field(description=("Booking status to include"))
        ] = "all",
        upcoming_only: Annotated[bool, Field(description="Only trips starting after today")] = False,
    ) -> BookingList:
        """List your bookings, most recent first."""
        return booking_list(instance_db(ctx), status, upcoming_only=upcoming_only)

    @server.tool(annotations=read_only)
    def get_profile(ctx: Context) -> Profile:
        """Your profile: travellers you can book for, saved payment cards (with expiry) and loyalty balance."""
        return profile(instance_db(ctx))

    @server.tool(annotations=read_only)
    def get_loyalty(ctx: Context) -> Loyalty:
        """Your loyalty points balance and the 20 most recent point movements."""
        return loyalty(instance_db(ctx))


SPEC = EnvironmentSpec(
    env_id="booking",
    version="v1",
    name="Booking",
    description="A travel booking site: search flights and hotels, hold, book, cancel, loyalty points.",
    schema_sql=SCHEMA,
    seed=seed,
    register_tools=register_tools,
    app=webui_routes("booking"),
    env_variables={"LOGGED_IN_USER": USER_EMAIL, "LOGGED_IN_NAME": USER_NAME, "APP_TODAY": TODAY},
    mcp_era="modern",
)
