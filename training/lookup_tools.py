"""Lookup tools drawn from word lists: the request and the right tool share a few words, nothing else.

    lookup_family(rng, subject)   one tool that looks up an attribute of a subject ("air quality" of a city,
                                  "firmware version" of a device), under a name styled one of several ways, with
                                  an optional second parameter, and the plain questions asking for it
    lookup_toolset(rng, n)        n of them, usually about one subject, so that only the attribute tells them apart
    lookup_names()                every name a lookup tool can take (the held-out check reads it)

The named families of training/requests.py are few, and a small model learns their names rather than the skill a
user's own tools need: read the offered tools, pick the one whose name and description hold the words of the
request, copy the value the request gives. These families are many (subjects x attributes x name styles) and are
offered beside each other with the same subject, so the attribute's words are the only cue, and the values (codes,
names, hosts) must be copied exactly.
"""

from __future__ import annotations

import random
from typing import Any, Callable

from training.chats import CITIES, COUNTRIES, FIRST_NAMES
from training.requests import DEVICES, PRODUCTS, STOCKS, TEAMS, Family, _person, function, say_date


def _code(rng: random.Random) -> str:
    """An identifier as systems print them: letters and digits, sometimes a dash."""
    letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(rng.randint(1, 3)))
    n = rng.randint(3, 9)
    digits = str(rng.randint(10 ** (n - 1), 10 ** n - 1))
    return f"{letters}{rng.choice(('', '', '-'))}{digits}"


def _host(rng: random.Random) -> str:
    return f"{rng.choice(('web', 'db', 'cache', 'api', 'build', 'edge'))}-{rng.randint(1, 40)}" \
        f"{rng.choice(('', '.internal', '.example.net'))}"


def _handle(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES).lower()}{rng.choice(('', '_', '.'))}{rng.randint(1, 999)}"


# subject -> (parameter names, value drawn, attributes one can ask of it)
SUBJECTS: dict[str, tuple[tuple[str, ...], Callable[[random.Random], str], tuple[str, ...]]] = {
    "city": (("city", "location", "place"), lambda r: r.choice(CITIES),
             ("noise level", "air quality", "time zone", "elevation", "sunrise time", "average rent", "pollen count",
              "parking fees", "public holidays", "water hardness", "crime rate", "recycling days")),
    "country": (("country", "country_name"), lambda r: r.choice(COUNTRIES),
                ("emergency number", "currency", "calling code", "national anthem", "driving side",
                 "official languages", "visa rules", "voltage")),
    "ticker": (("ticker", "symbol"), lambda r: r.choice(STOCKS),
               ("dividend yield", "market cap", "earnings date", "analyst rating", "trading volume", "opening price",
                "price target", "short interest")),
    "account": (("account_id", "account"), _code,
                ("balance", "last login", "credit limit", "pending charges", "billing plan", "renewal date")),
    "order": (("order_id", "order_number", "reference"), _code,
              ("delivery date", "shipping status", "refund status", "invoice total", "return label")),
    "product": (("product", "item"), lambda r: r.choice(PRODUCTS),
                ("stock level", "customer reviews", "warranty period", "dimensions", "release date", "sale price")),
    "device": (("device", "device_name"), lambda r: r.choice(DEVICES),
               ("battery level", "firmware version", "power usage", "uptime", "error log", "wifi signal")),
    "employee": (("employee", "name", "person"), _person,
                 ("phone extension", "manager", "office location", "start date", "vacation days", "job title")),
    "team": (("team", "club"), lambda r: r.choice(TEAMS),
             ("league position", "next match", "top scorer", "coach", "home ground", "last result")),
    "server": (("host", "hostname", "server"), _host,
               ("cpu load", "disk usage", "open ports", "certificate expiry", "memory usage", "kernel version")),
    "user": (("username", "user", "handle"), _handle,
             ("follower count", "recent posts", "karma", "join date", "profile bio", "badges")),
    "ticket": (("ticket_id", "ticket"), _code,
               ("assignee", "priority", "resolution", "comment count", "due date", "linked tickets")),
}
VERBS = ("get", "get", "fetch", "lookup", "check", "query", "read", "")
DESCRIPTIONS = ("{Verb} the {attr} of a {subject}.", "Returns the {attr} for the given {subject}.",
                "{Attr} by {subject}.", "Look up a {subject}'s {attr}.", "The current {attr} of one {subject}.")
ASKS = ("What's the {attr} of {v}?", "What is the {attr} for {v}?", "Can you check the {attr} for {v}?",
        "I need the {attr} of {subject} {v}.", "{Attr} for {v}?", "How is the {attr} looking for {v}?",
        "Look up the {attr} of {v}.", "Tell me the {attr} for the {subject} {v}.", "{v}: {attr}?",
        "Any idea what the {attr} of {v} is?", "Find out the {attr} of {subject} {v}.",
        "I'd like to know the {attr} for {v}.", "Quick check on {v} - what's its {attr}?")
REPORTS = ("The {attr} of {v} is {x}.", "{v}: {attr} {x}.", "It says the {attr} for {v} is {x}.",
           "{Attr} of {v}: {x}.")


def _styles(verb: str, words: list[str]) -> list[str]:
    """A tool name in the styles APIs use: verb_attr, attrLookup-like camelCase, PascalCase."""
    parts = ([verb] if verb else []) + words
    snake = "_".join(parts)
    camel = parts[0] + "".join(p.capitalize() for p in parts[1:])
    return [snake, snake, camel, "".join(p.capitalize() for p in parts)]


def lookup_names() -> set[str]:
    """Every name lookup_family can give a tool."""
    names = set()
    for subject, (_, _, attrs) in SUBJECTS.items():
        for attr in attrs:
            for verb in VERBS:
                for words in (attr.split(), [subject, *attr.split()]):
                    names.update(_styles(verb, words))
    return names


def _second(rng: random.Random) -> tuple[str, dict, Callable[[random.Random], tuple[Any, str]]] | None:
    """An optional parameter beside the subject: (name, schema, rng -> (value, how the request says it))."""
    x = rng.random()
    if x < 0.4:
        return None
    if x < 0.55:
        def date(r):
            iso, said = say_date(r)
            return iso, r.choice((f" on {said}", f" for {said}", f" as of {said}"))
        return "date", {"type": "string", "description": "YYYY-MM-DD"}, date
    if x < 0.7:
        def limit(r):
            n = r.randint(2, 20)
            return n, r.choice((f" (top {n})", f", just {n} of them", f", limit {n}"))
        return rng.choice(("limit", "max_results")), {"type": "integer", "default": 5}, limit
    if x < 0.85:
        def detailed(r):
            return True, r.choice((" with full details", " in detail", ", detailed please"))
        return rng.choice(("detailed", "verbose", "include_history")), {"type": "boolean", "default": False}, detailed
    def currency(r):
        cur, said = r.choice((("USD", "in dollars"), ("EUR", "in euros"), ("GBP", "in pounds"), ("JPY", "in yen")))
        return cur, f" {said}"
    return "currency", {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]}, currency


def _value(rng: random.Random, attr: str) -> Any:
    """What the tool returns for an attribute: a number or a short string."""
    if any(w in attr for w in ("date", "time", "expiry", "login", "day")):
        return say_date(rng)[0]
    if any(w in attr for w in ("count", "level", "population", "load", "usage", "yield", "balance", "price", "total",
                               "days", "limit", "cap", "volume", "rent", "fees", "karma", "position")):
        return rng.randint(2, 9999)
    return f"{rng.choice(('A', 'B', 'C', 'K', 'M'))}{rng.randint(1, 99)}" if rng.random() < 0.3 else \
        rng.choice(("normal", "high", "low", "ok", "pending", "none", "unknown", "active"))


def lookup_family(rng: random.Random, subject: str | None = None, taken: set[str] = frozenset()) -> Family:
    """A tool that looks up one attribute of `subject` (random if None), its name not in `taken`."""
    subject = subject or rng.choice(list(SUBJECTS))
    keys, draw, attrs = SUBJECTS[subject]
    for _ in range(20):
        attr, verb = rng.choice(attrs), rng.choice(VERBS)
        words = attr.split() if rng.random() < 0.7 else [subject, *attr.split()]
        name = rng.choice(_styles(verb, words))
        if name not in taken:
            break
    key = rng.choice(keys)
    second = _second(rng)
    props: dict[str, Any] = {key: {"type": "string"}}
    if rng.random() < 0.4:
        props[key]["description"] = f"The {subject}'s {key.replace('_', ' ')}."
    if second:
        props[second[0]] = second[1]
    fill = {"attr": attr, "Attr": attr[:1].upper() + attr[1:], "subject": subject,
            "Verb": (verb or "get").capitalize()}
    desc = rng.choice(DESCRIPTIONS).format(**fill) if rng.random() < 0.85 else None

    def ask(r: random.Random) -> tuple[dict, list[str]]:
        v = draw(r)
        args: dict[str, Any] = {key: v}
        extra = ""
        if second and r.random() < 0.6:
            args[second[0]], extra = second[2](r)
        sents = []
        for t in r.sample(ASKS, 4):
            s = t.format(v=v, **fill)
            sents.append(s[:-1] + extra + s[-1] if extra else s)
        return args, sents

    def report(r: random.Random, a: dict) -> tuple[dict, list[str]]:
        x = _value(r, attr)
        res = {"_".join(attr.split()): x, key: a[key]}
        return res, [t.format(v=a[key], x=x, **fill) for t in r.sample(REPORTS, 2)]

    return Family(function(name, desc, props, [key]), ask, report, f"the {attr} of a {subject}")


def lookup_toolset(rng: random.Random, n: int) -> list[Family]:
    """n lookup tools, all about one subject two times in three (only the attribute's words tell them apart), their
    names and attributes distinct."""
    same = rng.random() < 0.67
    subject = rng.choice(list(SUBJECTS))
    out: list[Family] = []
    names: set[str] = set()
    topics: set[str] = set()
    for _ in range(4 * n):
        f = lookup_family(rng, subject if same else None, names)
        if f.name not in names and f.topic not in topics:
            out.append(f)
            names.add(f.name)
            topics.add(f.topic)
        if len(out) == n:
            break
    return out
