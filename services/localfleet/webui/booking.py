"""The booking app's web UI: flight and hotel search, an offer with its booking form, my trips (cancel), profile.

Every change goes through `environments.booking`'s operations (the MCP tools' own code path). Booking from
the offer page holds the offer and books the hold in one step (a failed booking releases its hold).
"""

from __future__ import annotations

import sqlite3
from datetime import datetime

from mcp.server.mcpserver.exceptions import ToolError
from pydantic import TypeAdapter
from starlette.routing import BaseRoute

from rlgate.localfleet.environments import booking as bk
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
    routes,
    seg,
    url,
)

_PASSENGERS = TypeAdapter(bk.Passengers)
_TABS = (("upcoming", "Upcoming"), ("past", "Past"), ("cancelled", "Cancelled"), ("all", "All"))


def _usd(value: float) -> str:
    return f"${value:,.2f}"


def _when(value: str) -> str:
    return value.replace("T", " ")


def _short(value: str) -> str:
    """'2026-03-10T20:15' as 'Mar 10 20:15' (fits a table cell at 1024 px)."""
    return datetime.fromisoformat(value).strftime("%b %d %H:%M")


def _sidebar(conn: sqlite3.Connection, active: str) -> Html:
    p = bk.profile(conn)
    items = [
        h('<div class="head">Signed in</div><a href="profile"><span>{name}</span></a>', name=p.name),
        h(
            '<a href="profile"><span>Loyalty points</span><span class="count">{pts}</span></a>',
            pts=f"{p.loyalty_points:,}",
        ),
        Html('<div class="head">Upcoming trips</div>'),
    ]
    for b in bk.booking_list(conn, "confirmed", upcoming_only=True).bookings[:10]:
        items.append(
            h(
                '<a class="{on}" href="trips/{conf}" title="{desc}"><span>{conf}</span>'
                '<span class="count">{start}</span></a>',
                on="on" if active == "trips:" + b.confirmation else "",
                conf=b.confirmation,
                desc=b.description,
                start=b.start[:10],
            )
        )
    return join(items)


SHELL = Shell(
    name="Travel",
    user=f"{bk.USER_NAME} <{bk.USER_EMAIL}>",
    nav=(
        ("flights", "Flights", "flights"),
        ("hotels", "Hotels", "hotels"),
        ("trips", "My trips", "trips"),
        ("profile", "Profile", "profile"),
    ),
    sidebar=_sidebar,
)


def _radios(name: str, options: list[tuple[str, str]], current: str) -> Html:
    return join(
        h(
            '<label style="margin-right:14px"><input type="radio" name="{name}" value="{value}"{on}>{label}</label>',
            name=name,
            value=value,
            on=Html(" checked") if value == current else "",
            label=label,
        )
        for value, label in options
    )


def _error_box(message: str) -> Html:
    return h('<div class="box" style="border-color:#ff8182;color:#a40e26" role="alert">{m}</div>', m=message)


def flights(conn: sqlite3.Connection, req: Req) -> Page:
    origin, dest, day = (req.arg(k).strip()[:10] for k in ("from", "to", "date"))
    cabin, sort = req.arg("cabin"), req.arg("sort", "price")
    form = h(
        '<form method="get" action="flights" class="box"><div style="display:flex;gap:12px;align-items:flex-end">'
        '<label>From<br><input type="text" name="from" value="{origin}" placeholder="SFO" style="width:110px"></label>'
        '<label>To<br><input type="text" name="to" value="{dest}" placeholder="JFK" style="width:110px"></label>'
        '<label>Date<br><input type="text" name="date" value="{day}" placeholder="YYYY-MM-DD" style="width:140px">'
        '</label><button class="primary" type="submit">Search flights</button></div>'
        '<div class="choices" style="display:flex;margin-top:8px"><span class="muted" style="width:60px">Cabin</span>'
        "{cabins}</div>"
        '<div class="choices" style="display:flex"><span class="muted" style="width:60px">Sort</span>{sorts}</div>'
        "</form>",
        origin=origin,
        dest=dest,
        day=day,
        cabins=_radios("cabin", [("", "Any"), ("economy", "Economy"), ("business", "Business")], cabin),
        sorts=_radios("sort", [("price", "Cheapest first"), ("departure", "Earliest first")], sort),
    )
    results = Html("")
    if origin or dest or day:
        try:
            if cabin not in ("", "economy", "business") or sort not in ("price", "departure"):
                raise BadInput("choose a cabin and a sort order from the list")
            if not (origin and dest and day):
                raise BadInput("fill in From, To and Date")
            offers = bk.flights(conn, origin, dest, day, cabin=cabin or None, sort=sort, limit=20).offers
        except (ToolError, BadInput) as exc:
            results = _error_box(str(exc))
        else:
            rows = join(
                h(
                    "<tr><td>{no}</td><td>{airline}</td><td>{dep}</td><td>{arr}</td><td>{cabin}</td><td>{price}</td>"
                    "<td>{seats}</td><td>{refund}</td><td>{select}</td></tr>",
                    no=o.flight_no,
                    airline=o.airline,
                    dep=_short(o.depart_at),
                    arr=_short(o.arrive_at),
                    cabin=o.cabin,
                    price=_usd(o.price_usd),
                    seats=o.seats_left,
                    refund="yes" if o.refundable else "no",
                    select=h('<a class="button" href="offer/{id}">Select</a>', id=o.offer_id)
                    if o.seats_left
                    else Html('<span class="muted">Sold out</span>'),
                )
                for o in offers
            )
            results = h(
                '<h2>{n} fares</h2><table class="list"><colgroup><col style="width:75px"><col><col style="width:120px">'
                '<col style="width:120px"><col style="width:85px"><col style="width:85px"><col style="width:55px">'
                '<col style="width:95px"><col style="width:95px"></colgroup><tr><th>Flight</th><th>Airline</th>'
                "<th>Departs</th><th>Arrives</th><th>Cabin</th><th>Price</th><th>Seats</th><th>Refundable</th><th></th>"
                "</tr>{rows}</table>",
                n=len(offers),
                rows=rows or Html('<tr><td colspan="9" class="muted">No flights on that day</td></tr>'),
            )
    return Page("Flights", join([Html("<h1>Search flights</h1>"), form, results]), active="flights")


def hotels(conn: sqlite3.Connection, req: Req) -> Page:
    city, ci, co = (req.arg(k).strip()[:60] for k in ("city", "check_in", "check_out"))
    stars = req.arg("min_stars")
    form = h(
        '<form method="get" action="hotels" class="box"><div style="display:flex;gap:12px;align-items:flex-end">'
        '<label>City<br><input type="text" name="city" value="{city}" placeholder="Lisbon" style="width:160px"></label>'
        '<label>Check-in<br><input type="text" name="check_in" value="{ci}" placeholder="YYYY-MM-DD"'
        ' style="width:140px"></label>'
        '<label>Check-out<br><input type="text" name="check_out" value="{co}" placeholder="YYYY-MM-DD"'
        ' style="width:140px"></label><button class="primary" type="submit">Search hotels</button></div>'
        '<div class="choices" style="display:flex;margin-top:8px"><span class="muted" style="width:90px">Min stars'
        "</span>{stars}</div></form>",
        city=city,
        ci=ci,
        co=co,
        stars=_radios("min_stars", [("", "Any"), ("3", "3+"), ("4", "4+"), ("5", "5")], stars),
    )
    results = Html("")
    if city or ci or co:
        try:
            if stars not in ("", "3", "4", "5"):
                raise BadInput("choose a star rating from the list")
            if not (city and ci and co):
                raise BadInput("fill in City, Check-in and Check-out")
            offers = bk.hotels(conn, city, ci, co, min_stars=int(stars) if stars else None, limit=20).offers
        except (ToolError, BadInput) as exc:
            results = _error_box(str(exc))
        else:
            rows = join(
                h(
                    "<tr><td>{name}</td><td>{stars}</td><td>{rating}</td><td>{nightly}</td><td>{total}</td>"
                    "<td>{rooms}</td><td>{refund}</td><td>{select}</td></tr>",
                    name=o.hotel,
                    stars="\u2605" * o.stars,
                    rating=o.rating,
                    nightly=_usd(o.nightly_usd),
                    total=_usd(o.total_usd),
                    rooms=o.rooms_left,
                    refund="yes" if o.refundable else "no",
                    select=h('<a class="button" href="offer/{id}">Select</a>', id=o.offer_id)
                    if o.rooms_left
                    else Html('<span class="muted">Sold out</span>'),
                )
                for o in offers
            )
            results = h(
                '<h2>{n} hotels, {nights} nights</h2><table class="list"><colgroup><col><col style="width:100px">'
                '<col style="width:70px"><col style="width:100px"><col style="width:110px"><col style="width:70px">'
                '<col style="width:90px"><col style="width:100px"></colgroup><tr><th>Hotel</th><th>Stars</th>'
                "<th>Rating</th><th>Per night</th><th>Total</th><th>Rooms</th><th>Refundable</th><th></th></tr>"
                "{rows}</table>",
                n=len(offers),
                nights=offers[0].nights if offers else "-",
                rows=rows or Html('<tr><td colspan="8" class="muted">No hotels match</td></tr>'),
            )
    return Page("Hotels", join([Html("<h1>Search hotels</h1>"), form, results]), active="hotels")


def offer(conn: sqlite3.Connection, req: Req) -> Page:
    o = bk.offer(conn, req.path["offer_id"][:40])
    p = bk.profile(conn)
    if o.flight is not None:
        f = o.flight
        title = f"{f.flight_no} {f.origin} \u2192 {f.destination}"
        details = h(
            '<span class="k muted">Flight</span><span>{no} ({airline}), {cabin}</span>'
            '<span class="k muted">Departs</span><span>{dep} from {origin}</span>'
            '<span class="k muted">Arrives</span><span>{arr} at {dest}</span>'
            '<span class="k muted">Price</span><span>{price} per passenger</span>'
            '<span class="k muted">Seats left</span><span>{seats}</span>'
            '<span class="k muted">Refundable</span><span>{refund}</span>',
            no=f.flight_no,
            airline=f.airline,
            cabin=f.cabin,
            dep=_when(f.depart_at),
            origin=f.origin,
            arr=_when(f.arrive_at),
            dest=f.destination,
            price=_usd(f.price_usd),
            seats=f.seats_left,
            refund="yes" if f.refundable else "no",
        )
        count_label = "Passengers"
    else:
        assert o.hotel is not None
        ho = o.hotel
        title = ho.hotel
        details = h(
            '<span class="k muted">Hotel</span><span>{name}, {city} ({stars}, rated {rating})</span>'
            '<span class="k muted">Stay</span><span>{ci} to {co} ({nights} nights)</span>'
            '<span class="k muted">Price</span><span>{total} ({nightly} per night, one room)</span>'
            '<span class="k muted">Rooms left</span><span>{rooms}</span>'
            '<span class="k muted">Refundable</span><span>{refund}</span>',
            name=ho.hotel,
            city=ho.city,
            stars="\u2605" * ho.stars,
            rating=ho.rating,
            ci=ho.check_in,
            co=ho.check_out,
            nights=ho.nights,
            total=_usd(ho.total_usd),
            nightly=_usd(ho.nightly_usd),
            rooms=ho.rooms_left,
            refund="yes" if ho.refundable else "no",
        )
        count_label = "Guests"
    travellers = _radios(
        "traveller",
        [(str(t.id), f"{t.name} ({t.relation})") for t in p.travellers],
        str(next((t.id for t in p.travellers if t.is_primary), "")),
    )
    cards = _radios(
        "card",
        [(str(c.id), f"{c.brand} ending {c.last4} (expires {c.expires})") for c in p.payment_methods],
        str(next((c.id for c in p.payment_methods if c.is_default), "")),
    )
    body = h(
        "<h1>{title}</h1>"
        '<div class="box"><div class="grid">{details}</div></div>'
        '<form method="post" action="offer/{id}" class="box" style="margin-top:12px"><div class="grid">'
        '<label class="k" for="passengers">{count_label}</label><input type="number" id="passengers"'
        ' name="passengers" value="1" min="1" max="6" style="width:90px">'
        '<span class="k muted">Lead traveller</span><div class="choices">{travellers}</div>'
        '<span class="k muted">Pay with</span><div class="choices">{cards}</div>'
        '<label class="k" for="points">Points to redeem</label><span><input type="number" id="points" name="points"'
        ' value="0" min="0" style="width:120px"> <span class="muted">of {balance} (1 point = 1 cent)</span></span>'
        '<span></span><span><button class="primary" type="submit">Book now</button></span></div></form>',
        title=title,
        details=details,
        id=o.flight.offer_id if o.flight else o.hotel.offer_id if o.hotel else "",
        count_label=count_label,
        travellers=travellers,
        cards=cards,
        balance=f"{p.loyalty_points:,}",
    )
    return Page(title, body, active="flights" if o.flight else "hotels")


def _tab_of(b: bk.Booking, today: str) -> str:
    if b.status == "cancelled":
        return "cancelled"
    return "upcoming" if b.start[:10] > today else "past"


def trips(conn: sqlite3.Connection, req: Req) -> Page:
    tab = req.arg("tab", "upcoming")
    if tab not in dict(_TABS):
        raise BadInput("unknown tab")
    today = bk.TODAY
    all_trips = bk.booking_list(conn).bookings
    shown = [b for b in all_trips if tab == "all" or _tab_of(b, today) == tab]
    tabs = join(
        h(
            '<a class="button{on}" href="{href}">{label}</a>',
            on=" primary" if key == tab else "",
            href=url("trips", tab=key),
            label=label,
        )
        for key, label in _TABS
    )
    rows = join(
        h(
            '<tr><td><a href="trips/{conf}">{conf}</a></td><td>{desc}</td><td>{start}</td><td>{n}</td>'
            '<td><span class="badge {status}">{status}</span></td><td>{total}</td>'
            '<td><a class="button" href="trips/{conf}">View</a></td></tr>',
            conf=b.confirmation,
            desc=b.description,
            start=_when(b.start),
            n=b.passengers,
            status=b.status,
            total=_usd(b.total_usd),
        )
        for b in shown[:15]
    )
    body = h(
        '<h1>My trips</h1><div class="toolbar">{tabs}</div>'
        '<table class="list"><colgroup><col style="width:100px"><col><col style="width:150px"><col style="width:50px">'
        '<col style="width:110px"><col style="width:100px"><col style="width:90px"></colgroup>'
        "<tr><th>Booking</th><th>Trip</th><th>Starts</th><th>Pax</th><th>Status</th><th>Total</th><th></th></tr>"
        '{rows}</table><p class="muted">{note}</p>',
        tabs=tabs,
        rows=rows or Html('<tr><td colspan="7" class="muted">No trips here</td></tr>'),
        note=f"{len(shown)} trips" + (" (the 15 most recent shown)" if len(shown) > 15 else ""),
    )
    return Page("My trips", body, active="trips")


def _cancellable(b: bk.Booking) -> bool:
    return b.status == "confirmed" and b.start[:10] > bk.TODAY


def trip(conn: sqlite3.Connection, req: Req) -> Page:
    b = bk.booking(conn, req.path["conf"][:12])
    action = (
        h('<a class="button danger" href="trips/{conf}/cancel">Cancel booking</a>', conf=b.confirmation)
        if _cancellable(b)
        else Html("")
    )
    body = h(
        '<h1>Booking {conf} <span class="badge {status}">{status}</span></h1>'
        '<div class="toolbar">{action}<a class="button" href="trips">Back to my trips</a></div>'
        '<div class="box"><div class="grid">'
        '<span class="k muted">Trip</span><span>{desc}</span>'
        '<span class="k muted">From</span><span>{start}</span>'
        '<span class="k muted">To</span><span>{end}</span>'
        '<span class="k muted">{count_label}</span><span>{n}</span>'
        '<span class="k muted">Lead traveller</span><span>{traveller}</span>'
        '<span class="k muted">Paid with</span><span>{payment}</span>'
        '<span class="k muted">Total</span><span>{total}</span>'
        '<span class="k muted">Points redeemed</span><span>{points}</span>'
        '<span class="k muted">Charged to card</span><span>{charged}</span>'
        '<span class="k muted">Refundable</span><span>{refundable}</span>'
        '<span class="k muted">Refunded</span><span>{refund}</span>'
        "</div></div>",
        conf=b.confirmation,
        status=b.status,
        action=action,
        desc=b.description,
        start=_when(b.start),
        end=_when(b.end),
        count_label="Passengers" if b.kind == "flight" else "Guests",
        n=b.passengers,
        traveller=b.traveller,
        payment=b.payment,
        total=_usd(b.total_usd),
        points=f"{b.points_redeemed:,}",
        charged=_usd(b.charged_usd),
        refundable="yes" if b.refundable else "no",
        refund=_usd(b.refund_usd),
    )
    return Page(f"Booking {b.confirmation}", body, active="trips:" + b.confirmation)


def cancel_form(conn: sqlite3.Connection, req: Req) -> Page:
    b = bk.booking(conn, req.path["conf"][:12])
    if not _cancellable(b):
        raise BadInput(f"booking {b.confirmation} cannot be cancelled")
    outcome = (
        f"This fare is refundable: {_usd(b.charged_usd)} goes back to your card"
        + (f" and {b.points_redeemed:,} points to your account." if b.points_redeemed else ".")
        if b.refundable
        else "This fare is non-refundable: nothing will be refunded."
    )
    body = h(
        "<h1>Cancel booking {conf}?</h1>"
        '<div class="box"><p>{desc}, {start}</p><p>{outcome} Points earned on this booking are taken back.</p>'
        '<form method="post" action="trips/{conf}/cancel" class="toolbar">'
        '<button class="danger" type="submit">Yes, cancel booking</button>'
        '<a class="button" href="trips/{conf}">Keep booking</a></form></div>',
        conf=b.confirmation,
        desc=b.description,
        start=_when(b.start),
        outcome=outcome,
    )
    return Page("Cancel booking", body, active="trips:" + b.confirmation)


def profile(conn: sqlite3.Connection, req: Req) -> Page:
    p = bk.profile(conn)
    loyalty = bk.loyalty(conn)
    travellers = join(
        h(
            "<tr><td>{name}</td><td>{rel}</td><td>{dob}</td></tr>",
            name=t.name + (" (you)" if t.is_primary else ""),
            rel=t.relation,
            dob=t.date_of_birth,
        )
        for t in p.travellers
    )
    cards = join(
        h(
            "<tr><td>{brand} ending {last4}</td><td>{exp}</td><td>{default}</td></tr>",
            brand=c.brand,
            last4=c.last4,
            exp=c.expires,
            default="default" if c.is_default else "",
        )
        for c in p.payment_methods
    )
    history = join(
        h(
            "<tr><td>{when}</td><td>{reason}</td><td>{conf}</td><td>{pts}</td></tr>",
            when=_when(e.created_at),
            reason=e.reason,
            conf=e.confirmation or "-",
            pts=f"{e.points:+,}",
        )
        for e in loyalty.history[:8]
    )
    body = h(
        "<h1>{name} &middot; {email}</h1>"
        '<div style="display:flex;gap:16px"><div style="flex:1">'
        '<h2 style="margin-top:0">Travellers</h2><table class="list"><tr><th>Name</th><th>Relation</th>'
        "<th>Born</th></tr>{travellers}</table>"
        '<h2>Payment cards</h2><table class="list"><tr><th>Card</th><th>Expires</th><th></th></tr>{cards}</table>'
        '</div><div style="flex:1"><h2 style="margin-top:0">Loyalty: {balance} points</h2>'
        '<table class="list"><colgroup><col style="width:140px"><col><col style="width:90px"><col style="width:80px">'
        "</colgroup><tr><th>When</th><th>What</th><th>Booking</th><th>Points</th></tr>{history}</table></div></div>",
        name=p.name,
        email=p.email,
        travellers=travellers,
        cards=cards,
        balance=f"{loyalty.balance:,}",
        history=history,
    )
    return Page("Profile", body, active="profile")


# --- actions ---


def book(conn: sqlite3.Connection, req: Req) -> Done:
    offer_id = req.path["offer_id"][:40]
    passengers = checked(_PASSENGERS, number(req.value("passengers", "1"), "Passengers", low=1, high=6), "Passengers")
    traveller = number(req.value("traveller"), "Lead traveller", low=1) if req.value("traveller") else None
    card = number(req.value("card"), "Payment card", low=1) if req.value("card") else None
    if traveller is None or card is None:
        raise BadInput("choose a lead traveller and a payment card")
    points = number(req.value("points", "0") or "0", "Points to redeem", low=0)
    held = bk.hold(conn, offer_id, passengers)
    try:
        made = bk.book(conn, held.hold_id, traveller, card, points)
    except ToolError:
        bk.release(conn, held.hold_id)
        raise
    return Done(f"trips/{seg(made.confirmation)}", f"Booked: confirmation {made.confirmation}")


def cancel(conn: sqlite3.Connection, req: Req) -> Done:
    b = bk.cancel(conn, req.path["conf"][:12])
    return Done(f"trips/{seg(b.confirmation)}", f"Booking {b.confirmation} cancelled; refund {_usd(b.refund_usd)}")


def app_routes(connect: Connect) -> list[BaseRoute]:
    """The booking UI's routes, relative to the app root."""
    return routes(
        SHELL,
        connect,
        pages=[
            ("/", flights),  # at the app's own URL (where a screen opens)
            ("/flights", flights),
            ("/hotels", hotels),
            ("/offer/{offer_id}", offer),
            ("/trips", trips),
            ("/trips/{conf}", trip),
            ("/trips/{conf}/cancel", cancel_form),
            ("/profile", profile),
        ],
        actions=[
            ("/offer/{offer_id}", book),
            ("/trips/{conf}/cancel", cancel),
        ],
    )
