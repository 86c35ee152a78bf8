"""Tool requests in plain words: the tools people plug in, asked for the way people ask.

    FAMILIES                 tool families (a realistic JSON schema each: every JSON type, enums, arrays, nested
                             objects, optional fields, defaults), how a request for one is phrased, what it returns
    request_exchange(...)    a request for one (sometimes two) of the offered tools, the call(s), the result(s) fed
                             back and a final answer that uses them
    sample_request(rng, src) a `request` chat: one family's request, up to 3 distractor tools beside it
    sample_request_no_call   the same tools offered, a message that needs none of them

What the model must learn here is what a plain request asks of it: pick the offered tool whose name and description
fit the request (the others are distractors), and turn the words into the schema's values - "for two" -> 2,
"12 miles" -> 12 and "mi", "7:30 pm" -> "19:30", "$45" -> 45 and "USD", "non-stop only" -> true, "March 3, 2026"
-> "2026-03-03" when the description asks for YYYY-MM-DD - leaving out what the user did not say. Requests come as
questions, imperatives, indirect requests, with a sentence of context first, as two sentences, with typos, in
lower case; the values are never misspelled.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from training.chats import (
    CITIES,
    COUNTRIES,
    FIRST_NAMES,
    LANGUAGES,
    LAST_NAMES,
    MONTHS,
    Chat,
    Exchange,
    Sources,
    _assistant,
    _call_id,
    _chat,
    _pick_mode,
    _think,
)

NUM_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine",
             10: "ten", 11: "eleven", 12: "twelve", 14: "fourteen", 16: "sixteen", 20: "twenty", 25: "twenty-five",
             40: "forty", 50: "fifty", 90: "ninety", 100: "a hundred"}


def say_int(rng: random.Random, n: int) -> str:
    """A count as a person writes it: digits, or the word."""
    if n == 12 and rng.random() < 0.2:
        return "a dozen"
    return NUM_WORDS[n] if n in NUM_WORDS and rng.random() < 0.5 else str(n)


def say_date(rng: random.Random) -> tuple[str, str]:
    """(YYYY-MM-DD, the date as said)."""
    y, m, d = rng.randint(2024, 2029), rng.randint(1, 12), rng.randint(1, 28)
    iso = f"{y}-{m:02d}-{d:02d}"
    th = {1: "st", 2: "nd", 3: "rd", 21: "st", 22: "nd", 23: "rd"}.get(d, "th")
    return iso, rng.choice((iso, f"{MONTHS[m - 1]} {d}, {y}", f"{d} {MONTHS[m - 1]} {y}",
                            f"the {d}{th} of {MONTHS[m - 1]} {y}", f"{MONTHS[m - 1][:3]} {d} {y}"))


def say_time(rng: random.Random) -> tuple[str, str]:
    """(HH:MM on a 24-hour clock, the time as said)."""
    h, m = rng.randint(6, 23), rng.choice((0, 0, 15, 30, 45))
    hhmm = f"{h:02d}:{m:02d}"
    h12, ap = (h - 1) % 12 + 1, "am" if h < 12 else "pm"
    forms = [hhmm, f"{h12}:{m:02d} {ap}", f"{h12}:{m:02d}{ap}"]
    if m == 0:
        forms += [f"{h12} {ap}", f"{h12}{ap}", f"{h12} o'clock in the {'morning' if h < 12 else 'evening'}"
                  if h < 12 or h >= 18 else f"{h12} in the afternoon"]
    if m == 30:
        forms.append(f"half past {h12} {ap}")
    if (h, m) == (12, 0):
        forms.append("noon")
    return hhmm, rng.choice(forms)


CURRENCY = {"USD": ("$", "dollars"), "EUR": ("€", "euros"), "GBP": ("£", "pounds"), "JPY": ("¥", "yen"),
            "INR": ("₹", "rupees"), "CAD": ("C$", "Canadian dollars")}


def say_money(rng: random.Random, lo: int = 5, hi: int = 900) -> tuple[float, str, str]:
    """(amount, ISO currency, as said: "$45", "45 dollars", "45.50 USD")."""
    amount = rng.randint(lo, hi) + rng.choice((0, 0, 0.5, 0.25, 0.99))
    cur = rng.choice(("USD", "USD", "EUR", "GBP", "JPY", "INR", "CAD"))
    sym, word = CURRENCY[cur]
    a = f"{amount:.2f}" if amount != int(amount) else str(int(amount))
    return amount, cur, rng.choice((f"{sym}{a}", f"{a} {word}", f"{a} {cur}"))


# unit code -> how people write it
UNIT_WORDS = {"km": ("km", "kilometers", "kilometres"), "mi": ("miles", "mi", "mile"), "m": ("meters", "metres", "m"),
              "ft": ("feet", "ft", "foot"), "kg": ("kg", "kilograms", "kilos"), "lb": ("pounds", "lbs", "lb"),
              "g": ("grams", "g"), "oz": ("ounces", "oz"), "l": ("liters", "litres", "l"),
              "ml": ("milliliters", "ml"), "gal": ("gallons", "gal"), "c": ("degrees celsius", "celsius", "°C"),
              "f": ("degrees fahrenheit", "fahrenheit", "°F"), "h": ("hours", "hrs"), "min": ("minutes", "mins")}
UNIT_KIND = {"length": ("km", "mi", "m", "ft"), "mass": ("kg", "lb", "g", "oz"), "volume": ("l", "ml", "gal"),
             "temperature": ("c", "f"), "time": ("h", "min")}
TEAMS = ("Lions", "Rovers", "United", "Falcons", "Tigers", "Wanderers", "Comets", "Pirates", "Giants", "Rangers")
COINS = ("bitcoin", "ether", "solana", "litecoin", "dogecoin")
STOCKS = ("TSLA", "AAPL", "GOOG", "META", "IBM", "KO", "NKE", "BABA", "UBER", "AMD", "DIS", "PEP")
SONGS = ("Blue Monday", "Clair de Lune", "Bohemian Rhapsody", "Take Five", "Heroes", "Hallelujah", "Yesterday")
ARTISTS = ("Nina Simone", "Miles Davis", "Queen", "Radiohead", "Adele", "Bach", "Daft Punk")
INGREDIENTS = ("chicken", "rice", "tofu", "spinach", "tomatoes", "chickpeas", "mushrooms", "eggs", "salmon",
               "potatoes", "lentils", "garlic")
PRODUCTS = ("running shoes", "wireless headphones", "desk lamp", "coffee grinder", "yoga mat", "backpack",
            "phone case", "water bottle")
DEVICES = ("fan", "oven", "speaker", "blinds", "sprinkler", "robot vacuum", "heater", "kettle")
AIRLINE = ("LH", "BA", "AF", "KL", "UA", "DL", "QF", "EK", "TK", "SQ")


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def _mail(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES).lower()}@{rng.choice(('example.com', 'mail.test', 'corp.example'))}"


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


def function(name: str, description: str | None, properties: dict, required: list[str]) -> dict:
    fn: dict[str, Any] = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": fn}


@dataclass
class Family:
    """A tool: its OpenAI definition (`spec`), `ask` (rng -> the call's arguments and sentences asking for it) and
    `report` (rng, arguments -> the tool's JSON result and final answers that use it). `topic`: what it is about,
    for the reasoning."""

    spec: dict
    ask: Callable[[random.Random], tuple[dict, list[str]]]
    report: Callable[[random.Random, dict], tuple[dict, list[str]]]
    topic: str

    @property
    def name(self) -> str:
        return self.spec["function"]["name"]


def weather(rng: random.Random) -> Family:
    name, key = rng.choice((("get_weather", "city"), ("get_current_weather", "location"),
                               ("current_conditions", "city")))
    spec = function(name, "Get the current weather for a city.",
                    {key: {"type": "string", "description": "City name, e.g. Paris"},
                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}}, [key])

    def ask(r):
        c = r.choice(CITIES)
        args: dict[str, Any] = {key: c}
        u = ""
        if r.random() < 0.3:
            args["unit"] = r.choice(("celsius", "fahrenheit"))
            u = r.choice((f" in {args['unit']}", f", {args['unit']} please"))
        return args, [f"What's the weather like in {c}{u}?", f"Is it raining in {c}{u}?", f"how hot is it in {c}{u}",
                      f"I'm flying to {c} tomorrow. What's the weather there{u}?", f"Weather for {c}{u}, please.",
                      f"Should I take a jacket in {c}? Check the weather{u}."]

    def report(r, a):
        t, cond = r.randint(-5, 35), r.choice(("sunny", "cloudy", "light rain", "windy", "clear"))
        unit = a.get("unit", "celsius")
        return {"temperature": t, "unit": unit, "conditions": cond}, [
            f"It is {cond} in {a[key]} at {t} degrees {unit}.", f"{a[key]}: {t} degrees {unit} and {cond}."]
    return Family(spec, ask, report, "the weather")


def stock_price(rng: random.Random) -> Family:
    spec = function("get_stock_price", "Get the latest price of a stock by its ticker symbol.",
                    {"ticker": {"type": "string"}}, ["ticker"])

    def ask(r):
        t = r.choice(STOCKS)
        return {"ticker": t}, [f"Stock price for {t}?", f"How is {t} doing today?", f"price of {t} stock",
                               f"Check {t} for me.", f"What does one share of {t} cost right now?"]

    def report(r, a):
        p = round(r.uniform(5, 700), 2)
        return {"ticker": a["ticker"], "price": p}, [f"{a['ticker']} is at {_num(p)} dollars.",
                                                     f"One share of {a['ticker']} costs {_num(p)} dollars right now."]
    return Family(spec, ask, report, "a stock price")


def crypto_price(rng: random.Random) -> Family:
    spec = function("crypto_price", "Current price of a cryptocurrency in a fiat currency.",
                    {"coin": {"type": "string", "enum": list(COINS)},
                     "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"], "default": "USD"}}, ["coin"])

    def ask(r):
        c = r.choice(COINS)
        args: dict[str, Any] = {"coin": c}
        cur = ""
        if r.random() < 0.4:
            args["currency"] = r.choice(("EUR", "GBP"))
            cur = f" in {CURRENCY[args['currency']][1]}"
        return args, [f"How much is {c} worth{cur}?", f"What's the price of {c}{cur} today?",
                      f"{c} price{cur}?"]

    def report(r, a):
        p = round(r.uniform(0.1, 60000), 2)
        return {"price": p}, [f"{a['coin'].capitalize()} is worth {_num(p)} {a.get('currency', 'USD')}."]
    return Family(spec, ask, report, "a cryptocurrency price")


def convert_currency(rng: random.Random) -> Family:
    spec = function("convert_currency", "Convert an amount of money from one currency to another.",
                    {"amount": {"type": "number"}, "from_currency": {"type": "string", "description": "ISO code"},
                     "to_currency": {"type": "string", "description": "ISO code"}},
                    ["amount", "from_currency", "to_currency"])

    def ask(r):
        amount, cur, said = say_money(r)
        to = r.choice([c for c in CURRENCY if c != cur])
        return {"amount": amount, "from_currency": cur, "to_currency": to}, [
            f"How much is {said} in {CURRENCY[to][1]}?", f"Convert {said} to {to}.",
            f"I have {said}. What is that in {CURRENCY[to][1]}?", f"{said} to {to}?"]

    def report(r, a):
        v = round(a["amount"] * r.uniform(0.2, 3), 2)
        return {"result": v, "currency": a["to_currency"]}, [f"That is {_num(v)} {a['to_currency']}.",
                                                             f"You get {_num(v)} {a['to_currency']}."]
    return Family(spec, ask, report, "a currency conversion")


def convert_units(rng: random.Random) -> Family:
    name, (kv, kf, kt) = rng.choice((("convert_units", ("value", "from_unit", "to_unit")),
                                        ("unit_converter", ("amount", "from", "to")),
                                        ("convert", ("value", "source_unit", "target_unit"))))
    units = [u for us in UNIT_KIND.values() for u in us]
    spec = function(name, "Convert a value from one unit to another.",
                    {kv: {"type": "number"}, kf: {"type": "string", "enum": units},
                     kt: {"type": "string", "enum": units}}, [kv, kf, kt])

    def ask(r):
        kind = r.choice(list(UNIT_KIND))
        a, b = r.sample(UNIT_KIND[kind], 2)
        v = r.choice((r.randint(1, 300), round(r.uniform(0.5, 99), 1)))
        sa, sb = r.choice(UNIT_WORDS[a]), r.choice(UNIT_WORDS[b])
        return {kv: v, kf: a, kt: b}, [f"Convert {v} {sa} to {sb}.", f"How many {sb} are {v} {sa}?",
                                       f"what is {v} {sa} in {sb}", f"I walked {v} {sa}. How far is that in {sb}?"
                                       if kind == "length" else f"{v} {sa} is how many {sb}?",
                                       f"Please change {v} {sa} into {sb}."]

    def report(r, a):
        v = round(r.uniform(0.1, 2000), 2)
        return {"result": v, "unit": a[kt]}, [f"{_num(a[kv])} {a[kf]} is {_num(v)} {a[kt]}.",
                                              f"That comes to {_num(v)} {a[kt]}."]
    return Family(spec, ask, report, "a unit conversion")


def search_flights(rng: random.Random) -> Family:
    spec = function("search_flights", "Search for flights between two cities.",
                    {"origin": {"type": "string"}, "destination": {"type": "string"},
                     "date": {"type": "string", "description": "Departure date, YYYY-MM-DD"},
                     "passengers": {"type": "integer", "default": 1},
                     "cabin": {"type": "string", "enum": ["economy", "premium", "business"]},
                     "nonstop": {"type": "boolean", "description": "Only direct flights"}},
                    ["origin", "destination", "date"])

    def ask(r):
        o, d = r.sample(CITIES, 2)
        iso, day = say_date(r)
        args: dict[str, Any] = {"origin": o, "destination": d, "date": iso}
        extra = []
        if r.random() < 0.5:
            n = r.randint(2, 6)
            args["passengers"] = n
            extra.append(r.choice((f"for {say_int(r, n)} people", f"for {say_int(r, n)} travellers",
                                   f"{say_int(r, n)} passengers")))
        if r.random() < 0.3:
            args["cabin"] = r.choice(("economy", "premium", "business"))
            extra.append(f"in {args['cabin']} class")
        if r.random() < 0.3:
            args["nonstop"] = True
            extra.append(r.choice(("non-stop only", "direct flights only", "no layovers")))
        tail = (", " + ", ".join(extra)) if extra else ""
        return args, [f"Find flights from {o} to {d} on {day}{tail}.", f"Are there flights {o} to {d} on {day}{tail}?",
                      f"I need to get from {o} to {d} on {day}{tail}. What flights are there?",
                      f"Look up flights to {d} from {o}, leaving {day}{tail}."]

    def report(r, a):
        n, p = r.randint(1, 9), r.randint(60, 1400)
        return {"flights_found": n, "cheapest_price": p}, [
            f"I found {n} flights; the cheapest costs {p}.", f"There are {n} flights from {a['origin']} to "
            f"{a['destination']}, the cheapest at {p}."]
    return Family(spec, ask, report, "flights")


def flight_status(rng: random.Random) -> Family:
    spec = function("flight_status", "Status of a flight by flight number.",
                    {"flight_number": {"type": "string", "description": "e.g. LH123"},
                     "date": {"type": "string", "description": "YYYY-MM-DD"}}, ["flight_number"])

    def ask(r):
        f = f"{r.choice(AIRLINE)}{r.randint(10, 9999)}"
        args: dict[str, Any] = {"flight_number": f}
        if r.random() < 0.4:
            iso, day = say_date(r)
            args["date"] = iso
            return args, [f"Is flight {f} on {day} delayed?", f"Status of {f} on {day}?"]
        return args, [f"Is {f} on time?", f"Has flight {f} landed yet?", f"my mum is on {f}, any delay?"]

    def report(r, a):
        s = r.choice(("on time", "delayed by 40 minutes", "landed", "boarding"))
        return {"status": s}, [f"Flight {a['flight_number']} is {s}."]
    return Family(spec, ask, report, "a flight's status")


def find_hotels(rng: random.Random) -> Family:
    amen = ["pool", "gym", "parking", "wifi", "breakfast"]
    spec = function("find_hotels", "Find hotels in a city for given dates.",
                    {"city": {"type": "string"}, "check_in": {"type": "string", "description": "YYYY-MM-DD"},
                     "nights": {"type": "integer"}, "guests": {"type": "integer", "default": 2},
                     "max_price": {"type": "number", "description": "Per night"},
                     "amenities": {"type": "array", "items": {"type": "string", "enum": amen}}},
                    ["city", "check_in", "nights"])

    def ask(r):
        c = r.choice(CITIES)
        iso, day = say_date(r)
        n = r.randint(1, 10)
        args: dict[str, Any] = {"city": c, "check_in": iso, "nights": n}
        bits = []
        if r.random() < 0.4:
            g = r.choice((1, 3, 4, 5))
            args["guests"] = g
            bits.append(f"for {say_int(r, g)} guests" if g > 1 else "just for me")
        if r.random() < 0.4:
            args["max_price"] = r.choice((80, 100, 150, 200, 250))
            bits.append(f"under {args['max_price']} a night")
        if r.random() < 0.4:
            args["amenities"] = r.sample(amen, r.choice((1, 2)))
            bits.append("with " + " and ".join(args["amenities"]))
        tail = (" " + ", ".join(bits)) if bits else ""
        nights = "one night" if n == 1 else f"{say_int(r, n)} nights"
        return args, [f"Find me a hotel in {c} from {day} for {nights}{tail}.",
                      f"I need a place to stay in {c}, {nights} starting {day}{tail}.",
                      f"Any hotels in {c}? Checking in {day}, staying {nights}{tail}."]

    def report(r, a):
        name = f"Hotel {r.choice(('Aurora', 'Central', 'Riverside', 'Grand', 'Park'))}"
        p = r.randint(50, 300)
        return {"best_match": name, "price_per_night": p}, [f"{name} fits, at {p} per night.",
                                                             f"The best match is {name} for {p} a night."]
    return Family(spec, ask, report, "hotels")


def book_restaurant(rng: random.Random) -> Family:
    spec = function("book_restaurant", "Book a table at a restaurant.",
                    {"restaurant": {"type": "string"}, "people": {"type": "integer"},
                     "date": {"type": "string", "description": "YYYY-MM-DD"},
                     "time": {"type": "string", "description": "24-hour HH:MM"}},
                    ["restaurant", "people", "date", "time"])
    names = ("Luigi's", "The Green Door", "Sakura", "Casa Lola", "The Red Fox", "Bombay Palace", "Le Petit Zinc")

    def ask(r):
        rest, n = r.choice(names), r.randint(1, 8)
        iso, day = say_date(r)
        hhmm, t = say_time(r)
        return {"restaurant": rest, "people": n, "date": iso, "time": hhmm}, [
            f"Reserve {rest}: {say_int(r, n)} people, {day}, {t}.", f"Table for {say_int(r, n)} at {rest}, {day}, {t}.",
            f"Get us a table at {rest}, {day} around {t}. We are {say_int(r, n)}.",
            f"We'd like to eat at {rest} on {day} around {t}, {say_int(r, n)} people."]

    def report(r, a):
        code = f"{r.choice('ABCDEFGH')}{r.randint(100, 999)}"
        return {"booking_id": code}, [f"Booked: {a['restaurant']} for {a['people']}, reference {code}."]
    return Family(spec, ask, report, "a restaurant booking")


def send_email(rng: random.Random) -> Family:
    spec = function("send_email", "Send an email.",
                    {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"},
                     "cc": {"type": "array", "items": {"type": "string"}}}, ["to", "subject", "body"])
    subjects = ("lunch", "the report", "tomorrow's meeting", "the invoice", "holiday plans", "the budget")

    def ask(r):
        to, subj = _mail(r), r.choice(subjects)
        body = r.choice(("I will be late.", "Can we move it to Friday?", "Thanks for your help!",
                         "The numbers look good.", "Please call me back."))
        args: dict[str, Any] = {"to": to, "subject": subj, "body": body}
        cc = ""
        if r.random() < 0.3:
            args["cc"] = [_mail(r)]
            cc = f", cc {args['cc'][0]}"
        return args, [f"Email {to} about {subj}: \"{body}\"{cc}",
                      f"Send a mail to {to} with subject {subj} saying \"{body}\"{cc}.",
                      f"Write to {to}{cc}. Subject: {subj}. Text: {body}"]

    def report(r, a):
        return {"status": "sent"}, [f"The email to {a['to']} has been sent.", f"It was sent to {a['to']}."]
    return Family(spec, ask, report, "an email")


def create_reminder(rng: random.Random) -> Family:
    spec = function("create_reminder", "Create a reminder.",
                    {"text": {"type": "string"}, "date": {"type": "string", "description": "YYYY-MM-DD"},
                     "time": {"type": "string", "description": "HH:MM"},
                     "repeat": {"type": "string", "enum": ["none", "daily", "weekly", "monthly"], "default": "none"}},
                    ["text", "date"])
    things = ("call the dentist", "water the plants", "pay rent", "take my pills", "buy milk", "renew my passport")

    def ask(r):
        t = r.choice(things)
        iso, day = say_date(r)
        args: dict[str, Any] = {"text": t, "date": iso}
        at, rep = "", ""
        if r.random() < 0.5:
            hhmm, said = say_time(r)
            args["time"], at = hhmm, f" at {said}"
        if r.random() < 0.3:
            args["repeat"] = r.choice(("daily", "weekly", "monthly"))
            rep = {"daily": " every day", "weekly": " every week", "monthly": " every month"}[args["repeat"]]
        return args, [f"Remind me to {t} on {day}{at}{rep}.", f"Set a reminder: {t}, {day}{at}{rep}.",
                      f"Don't let me forget to {t} on {day}{at}{rep}!"]

    def report(r, a):
        n = r.randint(1, 999)
        return {"id": n, "created": True}, [f"Reminder {n} set: {a['text']} on {a['date']}."]
    return Family(spec, ask, report, "a reminder")


def set_timer(rng: random.Random) -> Family:
    spec = function("set_timer", "Start a countdown timer.",
                    {"minutes": {"type": "integer"}, "label": {"type": "string"}}, ["minutes"])

    def ask(r):
        m = r.choice((1, 3, 5, 10, 12, 15, 20, 25, 30, 45, 60, 90, 120))
        args: dict[str, Any] = {"minutes": m}
        said = {60: "an hour", 30: r.choice(("half an hour", "30 minutes")), 90: "an hour and a half",
                120: "two hours"}.get(m, f"{say_int(r, m)} minute{'s' if m > 1 else ''}")
        lab = ""
        if r.random() < 0.4:
            args["label"] = r.choice(("pasta", "laundry", "tea", "oven", "break"))
            lab = f" for the {args['label']}"
        return args, [f"Set a timer for {said}{lab}.", f"Timer {said}{lab} please", f"Start a {m}-minute timer{lab}.",
                      f"Can you time {said}{lab}?"]

    def report(r, a):
        return {"started": True, "minutes": a["minutes"]}, [f"Timer started for {a['minutes']} minutes."]
    return Family(spec, ask, report, "a timer")


def play_music(rng: random.Random) -> Family:
    spec = function("play_music", "Play a song or an artist.",
                    {"query": {"type": "string", "description": "Song or artist"}, "shuffle": {"type": "boolean"},
                     "volume": {"type": "integer", "minimum": 0, "maximum": 100}}, ["query"])

    def ask(r):
        q = r.choice(SONGS + ARTISTS)
        args: dict[str, Any] = {"query": q}
        bits = []
        if r.random() < 0.3:
            args["shuffle"] = True
            bits.append("on shuffle")
        if r.random() < 0.3:
            args["volume"] = r.choice((20, 30, 50, 70, 80))
            bits.append(f"at volume {args['volume']}")
        tail = (" " + " ".join(bits)) if bits else ""
        return args, [f"Play {q}{tail}.", f"Put on some {q}{tail}.", f"I want to listen to {q}{tail}."]

    def report(r, a):
        return {"playing": a["query"]}, [f"Now playing {a['query']}."]
    return Family(spec, ask, report, "music")


def search_recipes(rng: random.Random) -> Family:
    spec = function("search_recipes", "Find recipes by ingredients.",
                    {"ingredients": {"type": "array", "items": {"type": "string"}},
                     "max_minutes": {"type": "integer"},
                     "diet": {"type": "string", "enum": ["any", "vegetarian", "vegan", "keto"], "default": "any"}},
                    ["ingredients"])

    def ask(r):
        ing = r.sample(INGREDIENTS, r.choice((1, 2, 3)))
        args: dict[str, Any] = {"ingredients": ing}
        bits = []
        if r.random() < 0.4:
            args["max_minutes"] = r.choice((15, 20, 30, 45, 60))
            bits.append(f"ready in {args['max_minutes']} minutes")
        if r.random() < 0.3:
            args["diet"] = r.choice(("vegetarian", "vegan", "keto"))
            bits.append(args["diet"])
        listed = ", ".join(ing[:-1]) + (" and " if len(ing) > 1 else "") + ing[-1]
        tail = (", " + ", ".join(bits)) if bits else ""
        return args, [f"What can I cook with {listed}{tail}?", f"Recipes with {listed}{tail}?",
                      f"I have {listed} in the fridge. Find me a recipe{tail}."]

    def report(r, a):
        dish = r.choice(("stir fry", "curry", "omelette", "soup", "risotto"))
        return {"top_recipe": dish}, [f"Try a {dish}.", f"You could make a {dish}."]
    return Family(spec, ask, report, "recipes")


def translate_text(rng: random.Random) -> Family:
    spec = function("translate_text", "Translate text into another language.",
                    {"text": {"type": "string"}, "target_language": {"type": "string"},
                     "formal": {"type": "boolean", "default": False}}, ["text", "target_language"])
    phrases = {"good morning": ("bonjour", "guten Morgen", "buenos días", "buongiorno"),
               "thank you very much": ("merci beaucoup", "vielen Dank", "muchas gracias", "grazie mille"),
               "where is the station": ("où est la gare", "wo ist der Bahnhof", "dónde está la estación",
                                        "dov'è la stazione"),
               "see you soon": ("à bientôt", "bis bald", "hasta pronto", "a presto")}
    langs = ("French", "German", "Spanish", "Italian")

    def ask(r):
        p, lang = r.choice(list(phrases)), r.choice(langs)
        args: dict[str, Any] = {"text": p, "target_language": lang}
        f = ""
        if r.random() < 0.3:
            args["formal"] = True
            f = r.choice((", formally", " (polite form)"))
        return args, [f"Translate \"{p}\" into {lang}{f}.", f"How do you say \"{p}\" in {lang}{f}?",
                      f"What's \"{p}\" in {lang}{f}?"]

    def report(r, a):
        t = phrases[a["text"]][langs.index(a["target_language"])]
        return {"translation": t}, [f"In {a['target_language']}, \"{a['text']}\" is \"{t}\".", f"\"{t}\""]
    return Family(spec, ask, report, "a translation")


def book_taxi(rng: random.Random) -> Family:
    spec = function("book_taxi", "Order a taxi.",
                    {"pickup": {"type": "string"}, "dropoff": {"type": "string"},
                     "passengers": {"type": "integer", "default": 1},
                     "time": {"type": "string", "description": "HH:MM, 24-hour"}}, ["pickup", "dropoff"])
    places = ("the airport", "the central station", "the museum", "my office", "the stadium", "the harbour")

    def ask(r):
        a, b = r.sample(places, 2)
        args: dict[str, Any] = {"pickup": a, "dropoff": b}
        bits = ""
        if r.random() < 0.4:
            n = r.randint(2, 5)
            args["passengers"] = n
            bits += f" for {say_int(r, n)}"
        if r.random() < 0.5:
            hhmm, t = say_time(r)
            args["time"] = hhmm
            bits += f" at {t}"
        return args, [f"Get me a taxi from {a} to {b}{bits}.", f"Order a cab{bits} from {a} to {b}.",
                      f"I need a ride to {b} from {a}{bits}."]

    def report(r, a):
        m = r.randint(3, 20)
        return {"eta_minutes": m}, [f"A taxi will pick you up in {m} minutes."]
    return Family(spec, ask, report, "a taxi")


def calendar_event(rng: random.Random) -> Family:
    spec = function("create_event", "Add an event to the calendar.",
                    {"title": {"type": "string"}, "date": {"type": "string", "description": "YYYY-MM-DD"},
                     "start": {"type": "string", "description": "HH:MM"}, "duration_minutes": {"type": "integer"},
                     "attendees": {"type": "array", "items": {"type": "string"}}}, ["title", "date", "start"])
    titles = ("team sync", "dentist", "yoga class", "project review", "lunch with Sam", "budget planning")

    def ask(r):
        t = r.choice(titles)
        iso, day = say_date(r)
        hhmm, at = say_time(r)
        args: dict[str, Any] = {"title": t, "date": iso, "start": hhmm}
        bits = ""
        if r.random() < 0.4:
            d = r.choice((15, 30, 45, 60, 90))
            args["duration_minutes"] = d
            bits += " for an hour" if d == 60 else f" for {d} minutes"
        if r.random() < 0.3:
            args["attendees"] = [_mail(r) for _ in range(r.choice((1, 2)))]
            bits += " with " + " and ".join(args["attendees"])
        return args, [f"Put {t} in my calendar on {day} at {at}{bits}.", f"Schedule {t}: {day}, {at}{bits}.",
                      f"Add an event called {t} on {day} at {at}{bits}."]

    def report(r, a):
        eid = f"ev{r.randint(100, 999)}"
        return {"event_id": eid}, [f"{a['title']} is in your calendar on {a['date']} (event {eid}).",
                                   f"Added as event {eid}."]
    return Family(spec, ask, report, "a calendar event")


def get_news(rng: random.Random) -> Family:
    spec = function("get_news", "Latest news headlines.",
                    {"topic": {"type": "string"}, "limit": {"type": "integer", "default": 5},
                     "language": {"type": "string"}}, ["topic"])
    topics = ("science", "football", "technology", "climate", "elections", "space", "markets")

    def ask(r):
        t = r.choice(topics)
        args: dict[str, Any] = {"topic": t}
        n = ""
        if r.random() < 0.4:
            args["limit"] = r.choice((3, 10))
            n = f" {say_int(r, args['limit'])}"
        return args, [f"Give me the top{n} {t} headlines.", f"What's new in {t}?", f"Any{n} {t} news today?"]

    def report(r, a):
        h = f"{a['topic'].capitalize()} {r.choice(('record', 'breakthrough', 'update', 'surprise'))}"
        return {"headlines": [h]}, [f"The top story: {h}."]
    return Family(spec, ask, report, "news")


def bmi(rng: random.Random) -> Family:
    spec = function("calculate_bmi", "Body mass index from weight and height.",
                    {"weight_kg": {"type": "number"}, "height_cm": {"type": "number"}}, ["weight_kg", "height_cm"])

    def ask(r):
        w, h = r.randint(45, 120), r.randint(150, 200)
        return {"weight_kg": w, "height_cm": h}, [f"I weigh {w} kg and I'm {h} cm tall. What's my BMI?",
                                                  f"BMI for {w} kilos, {h} centimeters?"]

    def report(r, a):
        b = round(a["weight_kg"] / (a["height_cm"] / 100) ** 2, 1)
        return {"bmi": b}, [f"Your BMI is {b}."]
    return Family(spec, ask, report, "a BMI")


def track_order(rng: random.Random) -> Family:
    spec = function("track_order", "Where an online order is.", {"order_id": {"type": "string"}}, ["order_id"])

    def ask(r):
        o = f"{r.choice(('A', 'ORD-', 'X', '#'))}{r.randint(10000, 999999)}".lstrip("#")
        return {"order_id": o}, [f"Where is my order {o}?", f"Has order {o} shipped?", f"track order {o}",
                                 f"I ordered something last week, number {o}. Any update?"]

    def report(r, a):
        s = r.choice(("shipped", "out for delivery", "delivered", "being packed"))
        return {"status": s}, [f"Order {a['order_id']} is {s}."]
    return Family(spec, ask, report, "an order")


def smart_device(rng: random.Random) -> Family:
    spec = function("control_device", "Turn a smart home device on or off, or set its level.",
                    {"device": {"type": "string", "enum": list(DEVICES)}, "on": {"type": "boolean"},
                     "level": {"type": "integer", "description": "0-100"}}, ["device", "on"])

    def ask(r):
        d = r.choice(DEVICES)
        on = r.random() < 0.6
        args: dict[str, Any] = {"device": d, "on": on}
        lvl = ""
        if on and r.random() < 0.4:
            args["level"] = r.choice((10, 25, 50, 75, 100))
            lvl = f" at {args['level']} percent"
        if on:
            return args, [f"Turn on the {d}{lvl}.", f"Switch the {d} on{lvl}.", f"start the {d}{lvl}"]
        return args, [f"Turn off the {d}.", f"Switch the {d} off, please.", f"Stop the {d}."]

    def report(r, a):
        return {"device": a["device"], "on": a["on"]}, [f"The {a['device']} is now {'on' if a['on'] else 'off'}."]
    return Family(spec, ask, report, "a device")


def search_products(rng: random.Random) -> Family:
    spec = function("search_products", "Search the shop's catalog.",
                    {"query": {"type": "string"}, "max_price": {"type": "number"}, "in_stock": {"type": "boolean"},
                     "sort": {"type": "string", "enum": ["relevance", "price_asc", "price_desc", "rating"]}},
                    ["query"])

    def ask(r):
        q = r.choice(PRODUCTS)
        args: dict[str, Any] = {"query": q}
        bits = []
        if r.random() < 0.4:
            args["max_price"] = r.choice((20, 50, 100, 150))
            bits.append(f"under {args['max_price']} dollars")
        if r.random() < 0.3:
            args["in_stock"] = True
            bits.append("that are in stock")
        if r.random() < 0.3:
            args["sort"] = r.choice(("price_asc", "rating"))
            bits.append("cheapest first" if args["sort"] == "price_asc" else "best rated first")
        tail = (" " + ", ".join(bits)) if bits else ""
        return args, [f"Show me {q}{tail}.", f"Do you sell {q}{tail}?", f"I'm looking for {q}{tail}."]

    def report(r, a):
        p = round(r.uniform(5, 150), 2)
        return {"results": 3, "top_price": p}, [f"I found 3 {a['query']}; the first costs {_num(p)}."]
    return Family(spec, ask, report, "products")


def file_bug(rng: random.Random) -> Family:
    spec = function("create_issue", "Open an issue in the bug tracker.",
                    {"title": {"type": "string"}, "severity": {"type": "string", "enum": ["low", "medium", "high",
                                                                                          "critical"]},
                     "labels": {"type": "array", "items": {"type": "string"}}, "assignee": {"type": "string"}},
                    ["title", "severity"])
    titles = ("login page crashes", "slow search", "typo on the home page", "export fails", "dark mode broken")

    def ask(r):
        t, s = r.choice(titles), r.choice(("low", "medium", "high", "critical"))
        args: dict[str, Any] = {"title": t, "severity": s}
        bits = ""
        if r.random() < 0.3:
            args["labels"] = r.sample(["ui", "backend", "regression", "mobile"], 2)
            bits += f", labels {' and '.join(args['labels'])}"
        if r.random() < 0.3:
            args["assignee"] = r.choice(FIRST_NAMES)
            bits += f", assign it to {args['assignee']}"
        return args, [f"Open a {s} severity bug: {t}{bits}.", f"File an issue \"{t}\", severity {s}{bits}.",
                      f"We have a {s} problem: {t}. Log it{bits}."]

    def report(r, a):
        n = r.randint(100, 9999)
        return {"issue": n}, [f"Opened issue #{n}.", f"Issue {n} is filed."]
    return Family(spec, ask, report, "a bug report")


def local_time(rng: random.Random) -> Family:
    spec = function("get_local_time", "Current local time in a city.", {"city": {"type": "string"}}, ["city"])

    def ask(r):
        c = r.choice(CITIES)
        return {"city": c}, [f"What time is it in {c}?", f"Current time in {c}?", f"is it night in {c} now?"]

    def report(r, a):
        hhmm, _ = say_time(r)
        return {"time": hhmm}, [f"It is {hhmm} in {a['city']}."]
    return Family(spec, ask, report, "the time")


def showtimes(rng: random.Random) -> Family:
    spec = function("movie_showtimes", "Cinema showtimes for a film.",
                    {"movie": {"type": "string"}, "city": {"type": "string"},
                     "date": {"type": "string", "description": "YYYY-MM-DD"}}, ["movie", "city"])
    films = ("Dune", "The Matrix", "Amelie", "Spirited Away", "Arrival", "Paddington")

    def ask(r):
        m, c = r.choice(films), r.choice(CITIES)
        args: dict[str, Any] = {"movie": m, "city": c}
        if r.random() < 0.4:
            iso, day = say_date(r)
            args["date"] = iso
            return args, [f"When is {m} showing in {c} on {day}?", f"{m} showtimes, {c}, {day}?"]
        return args, [f"Where can I see {m} in {c}?", f"Is {m} playing in {c}?"]

    def report(r, a):
        hhmm, _ = say_time(r)
        return {"times": [hhmm]}, [f"{a['movie']} plays at {hhmm}."]
    return Family(spec, ask, report, "films")


def nutrition(rng: random.Random) -> Family:
    spec = function("nutrition_facts", "Calories and macros of a food.",
                    {"food": {"type": "string"}, "grams": {"type": "number", "default": 100}}, ["food"])

    def ask(r):
        f = r.choice(("banana", "oatmeal", "cheddar", "avocado", "almonds", "white rice"))
        if r.random() < 0.5:
            g = r.choice((30, 50, 150, 200, 250))
            return {"food": f, "grams": g}, [f"How many calories are in {g} grams of {f}?",
                                             f"Nutrition for {g}g of {f}?"]
        return {"food": f}, [f"How many calories does {f} have?", f"Is {f} high in protein?"]

    def report(r, a):
        k = r.randint(20, 700)
        return {"calories": k}, [f"That is {k} calories."]
    return Family(spec, ask, report, "nutrition")


def compound_interest(rng: random.Random) -> Family:
    spec = function("compound_interest", "Future value of savings with compound interest.",
                    {"principal": {"type": "number"}, "rate_percent": {"type": "number"}, "years": {"type": "integer"},
                     "compounds_per_year": {"type": "integer", "default": 12}}, ["principal", "rate_percent", "years"])

    def ask(r):
        p, rate, y = r.choice((1000, 2500, 10000, 50000)), r.choice((1.5, 2, 3.5, 5)), r.randint(1, 30)
        return {"principal": p, "rate_percent": rate, "years": y}, [
            f"If I save {p} at {rate}% for {say_int(r, y)} years, what will I have?",
            f"Compound interest on {p} at {rate} percent over {y} years?"]

    def report(r, a):
        v = round(a["principal"] * (1 + a["rate_percent"] / 100) ** a["years"], 2)
        return {"future_value": v}, [f"You would have {_num(v)}."]
    return Family(spec, ask, report, "savings")


def calculate_tip(rng: random.Random) -> Family:
    spec = function("calculate_tip", "Tip for a bill.",
                    {"bill_amount": {"type": "number"}, "tip_percentage": {"type": "number", "default": 15}},
                    ["bill_amount"])

    def ask(r):
        b = r.randint(10, 300) + r.choice((0, 0.5, 0.75))
        if r.random() < 0.5:
            t = r.choice((10, 18, 20, 22))
            return {"bill_amount": b, "tip_percentage": t}, [f"What's a {t}% tip on {_num(b)}?",
                                                             f"Tip {t} percent on a {_num(b)} bill?"]
        return {"bill_amount": b}, [f"How much should I tip on {_num(b)}?", f"Tip for a bill of {_num(b)}?"]

    def report(r, a):
        v = round(a["bill_amount"] * a.get("tip_percentage", 15) / 100, 2)
        return {"tip": v}, [f"The tip is {_num(v)}."]
    return Family(spec, ask, report, "a tip")


def rent_car(rng: random.Random) -> Family:
    spec = function("rent_car", "Rent a car.",
                    {"city": {"type": "string"}, "pickup_date": {"type": "string", "description": "YYYY-MM-DD"},
                     "days": {"type": "integer"}, "car_class": {"type": "string", "enum": ["compact", "suv", "van",
                                                                                          "electric"]}},
                    ["city", "pickup_date", "days"])

    def ask(r):
        c = r.choice(CITIES)
        iso, day = say_date(r)
        d = r.randint(1, 14)
        args: dict[str, Any] = {"city": c, "pickup_date": iso, "days": d}
        k = ""
        if r.random() < 0.4:
            args["car_class"] = r.choice(("compact", "suv", "van", "electric"))
            k = f" an {args['car_class']}" if args["car_class"][0] in "aeiou" else f" a {args['car_class']}"
        return args, [f"Rent me{k or ' a car'} in {c} from {day} for {say_int(r, d)} days.",
                      f"I need{k or ' a car'} in {c}, {say_int(r, d)} days starting {day}."]

    def report(r, a):
        p = r.randint(20, 120)
        return {"price_per_day": p}, [f"The car costs {p} per day."]
    return Family(spec, ask, report, "a rental car")


def add_contact(rng: random.Random) -> Family:
    spec = function("add_contact", "Save a contact in the address book.",
                    {"name": {"type": "string"}, "phone": {"type": "string"},
                     "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                                  "city": {"type": "string"}},
                                 "required": ["city"]}}, ["name"])

    def ask(r):
        n = _person(r)
        args: dict[str, Any] = {"name": n}
        bits = ""
        if r.random() < 0.6:
            args["phone"] = f"+{r.randint(1, 49)} {r.randint(100, 999)} {r.randint(1000, 9999)}"
            bits += f", phone {args['phone']}"
        if r.random() < 0.5:
            addr = {"city": r.choice(CITIES)}
            if r.random() < 0.5:
                addr = {"street": f"{r.randint(1, 99)} {r.choice(('Oak', 'High', 'Station'))} Road", **addr}
            args["address"] = addr
            bits += ", lives at " + ", ".join(addr.values())
        return args, [f"Save {n} as a contact{bits}.", f"Add {n} to my contacts{bits}.", f"new contact: {n}{bits}"]

    def report(r, a):
        n = r.randint(2, 400)
        return {"saved": True, "contacts": n}, [f"{a['name']} is saved; you now have {n} contacts."]
    return Family(spec, ask, report, "a contact")


def create_invoice(rng: random.Random) -> Family:
    spec = function("create_invoice", "Create an invoice for a customer.",
                    {"customer": {"type": "string"},
                     "lines": {"type": "array", "items": {"type": "object", "properties": {
                         "item": {"type": "string"}, "quantity": {"type": "integer"}, "price": {"type": "number"}},
                         "required": ["item", "quantity"]}},
                     "due_in_days": {"type": "integer", "default": 30}}, ["customer", "lines"])
    items = ("consulting hours", "logo design", "website hosting", "photo prints", "repair work")

    def ask(r):
        c = f"{r.choice(LAST_NAMES)} {r.choice(('Ltd', 'GmbH', 'and Sons', 'Studio'))}"
        lines = [{"item": it, "quantity": r.randint(1, 12)} for it in r.sample(items, r.choice((1, 2)))]
        said = " and ".join(f"{say_int(r, x['quantity'])} {x['item']}" for x in lines)
        args: dict[str, Any] = {"customer": c, "lines": lines}
        due = ""
        if r.random() < 0.3:
            args["due_in_days"] = r.choice((7, 14, 60))
            due = f", due in {args['due_in_days']} days"
        return args, [f"Invoice {c} for {said}{due}.", f"Create an invoice to {c}: {said}{due}.",
                      f"Bill {c} for {said}{due}."]

    def report(r, a):
        n = f"INV-{r.randint(1000, 9999)}"
        return {"invoice": n}, [f"Invoice {n} was created for {a['customer']}."]
    return Family(spec, ask, report, "an invoice")


def country_info(rng: random.Random) -> Family:
    spec = function("country_facts", "Facts about a country: capital, population, currency.",
                    {"country": {"type": "string"}, "fields": {"type": "array", "items": {
                        "type": "string", "enum": ["capital", "population", "currency", "languages"]}}}, ["country"])

    def ask(r):
        c = r.choice(COUNTRIES)
        f = r.sample(["population", "currency", "languages"], r.choice((1, 2)))
        said = " and ".join(f)
        return {"country": c, "fields": f}, [f"What is the {said} of {c}?", f"Look up the {said} of {c}.",
                                             f"Tell me {c}'s {said}."]

    def report(r, a):
        draw = {"population": lambda: r.randint(1, 300) * 100000, "currency": lambda: r.choice(list(CURRENCY)),
                "languages": lambda: r.choice(LANGUAGES)}
        res = {k: draw[k]() for k in a["fields"]}
        said = " and ".join(f"the {k} is {v}" for k, v in res.items())
        return res, [f"In {a['country']}, {said}.", f"{a['country']}: {said}."]
    return Family(spec, ask, report, "a country")


def book_class(rng: random.Random) -> Family:
    spec = function("book_fitness_class", "Book a place in a gym class.",
                    {"class_name": {"type": "string", "enum": ["yoga", "pilates", "spinning", "boxing", "zumba"]},
                     "date": {"type": "string", "description": "YYYY-MM-DD"}, "time": {"type": "string"}},
                    ["class_name", "date"])

    def ask(r):
        c = r.choice(("yoga", "pilates", "spinning", "boxing", "zumba"))
        iso, day = say_date(r)
        args: dict[str, Any] = {"class_name": c, "date": iso}
        at = ""
        if r.random() < 0.5:
            hhmm, t = say_time(r)
            args["time"], at = hhmm, f" at {t}"
        return args, [f"Sign me up for {c} on {day}{at}.", f"Book a {c} class, {day}{at}."]

    def report(r, a):
        n = r.randint(0, 12)
        return {"booked": True, "spots_left": n}, [f"You are booked for {a['class_name']}; {n} spots are left."]
    return Family(spec, ask, report, "a gym class")


def log_meal(rng: random.Random) -> Family:
    spec = function("log_meal", "Record a meal in the food diary.",
                    {"food": {"type": "string"}, "calories": {"type": "integer"},
                     "meal": {"type": "string", "enum": ["breakfast", "lunch", "dinner", "snack"]}},
                    ["food", "meal"])

    def ask(r):
        f, m = r.choice(("porridge", "a salad", "two eggs", "pasta", "an apple")), \
            r.choice(("breakfast", "lunch", "dinner", "snack"))
        args: dict[str, Any] = {"food": f, "meal": m}
        k = ""
        if r.random() < 0.5:
            args["calories"] = r.randint(80, 900)
            k = f", {args['calories']} calories"
        return args, [f"Log {f} for {m}{k}.", f"I had {f} for {m}{k}. Write it down.", f"add {f} as {m}{k}"]

    def report(r, a):
        t = r.randint(300, 2500)
        return {"today_total": t}, [f"Logged. You are at {t} calories today."]
    return Family(spec, ask, report, "a meal")


FAMILIES: tuple[Callable[[random.Random], Family], ...] = (
    weather, stock_price, crypto_price, convert_currency, convert_units, search_flights, flight_status, find_hotels,
    book_restaurant, send_email, create_reminder, set_timer, play_music, search_recipes, translate_text, book_taxi,
    calendar_event, get_news, bmi, track_order, smart_device, search_products, file_bug, local_time, showtimes,
    nutrition, compound_interest, calculate_tip, rent_car, add_contact, create_invoice, country_info, book_class,
    log_meal)


def camel(name: str) -> str:
    """A snake_case tool name as camelCase APIs write it (get_weather -> getWeather)."""
    first, *rest = name.split("_")
    return first + "".join(w.capitalize() for w in rest)


def family_names() -> set[str]:
    """Every tool name the families can take (weather and convert_units draw theirs from a few), in both styles,
    and every name of a lookup tool (training/lookup_tools.py)."""
    from training.lookup_tools import lookup_names

    names = {make(random.Random(seed)).name for make in FAMILIES for seed in range(40)}
    return names | {camel(n) for n in names} | lookup_names()


# -- how people phrase a request ------------------------------------------------------------------------------------
LEAD_INS = ("Hi!", "Hey, quick question.", "Good morning.", "Hello there.", "I'm planning my week.",
            "Okay so", "One more thing:", "This is for work.", "Need some help here.", "Hmm.")
POLITE = ("Could you {s}", "Can you please {s}", "Please {s}", "I'd like you to {s}", "Would you {s}",
          "Help me out: {s}", "{S} Thanks!", "{S} Thank you.", "I was hoping you could {s}", "Any chance you could {s}")


def _typos(rng: random.Random, text: str, keep: list[str]) -> str:
    """A letter dropped or doubled in one or two words that carry no value."""
    words = text.split(" ")
    ok = [i for i, w in enumerate(words) if len(w) > 3 and w.isalpha() and not any(w in k for k in keep)]
    for i in rng.sample(ok, min(len(ok), rng.choice((1, 1, 2)))):
        w, j = words[i], rng.randrange(1, len(words[i]) - 1)
        words[i] = w[:j] + w[j + 1:] if rng.random() < 0.5 else w[:j] + w[j] + w[j:]
    return " ".join(words)


def phrase(rng: random.Random, sentence: str, values: list[str]) -> str:
    """One request sentence as a user might type it."""
    x = rng.random()
    if x < 0.35:
        out = sentence
    elif x < 0.55:
        out = f"{rng.choice(LEAD_INS)} {sentence}"
    elif x < 0.75:
        wrap = rng.choice(POLITE)
        low = sentence if any(sentence.startswith(v) for v in values) else sentence[:1].lower() + sentence[1:]
        out = wrap.format(s=low.rstrip(".?!") + ("?" if wrap.startswith(("Could", "Can", "Would", "Any")) else "."),
                          S=sentence)
    elif x < 0.88:
        out = _typos(rng, sentence, values)
    else:
        out = sentence.rstrip(".?!")
        if all(v == v.lower() for v in values):
            out = out.lower()
    return out


def values_of(x: Any) -> list[str]:
    if isinstance(x, dict):
        return [s for v in x.values() for s in values_of(v)]
    if isinstance(x, list):
        return [s for v in x for s in values_of(v)]
    return [str(x)]


def _call_reasoning(rng: random.Random, calls: list[tuple[Family, dict]]) -> str:
    parts = []
    for fam, args in calls:
        said = ", ".join(f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
        parts.append(rng.choice((f"The user wants {fam.topic}; {fam.name} does that, with {said}.",
                                 f"{fam.name} fits: {said}.", f"Call {fam.name} with {said}.")))
    return " ".join(parts)


def request_exchange(rng: random.Random, mode: str, fams: list[Family], target: list[Family]) -> Exchange:
    """The user asks for what `target` (one or two of the offered `fams`) does; the call(s), the result(s), the
    answer. Expected: the first call's name and arguments (and all of them)."""
    calls = [(f, f.ask(rng)) for f in target]
    sentences = [phrase(rng, rng.choice(sents), values_of(args)) for _, (args, sents) in calls]
    user = sentences[0] if len(sentences) == 1 else f"{sentences[0]} {rng.choice(('Also,', 'And', 'Then'))} " \
        f"{sentences[1][:1].lower() + sentences[1][1:]}"
    tool_calls, results, answers = [], [], []
    for fam, (args, _) in calls:
        cid = _call_id(rng)
        tool_calls.append({"id": cid, "type": "function",
                           "function": {"name": fam.name, "arguments": json.dumps(args, ensure_ascii=False)}})
        res, said = fam.report(rng, args)
        results.append({"role": "tool", "tool_call_id": cid, "content": json.dumps(res, ensure_ascii=False)})
        answers.append(rng.choice(said))
    pairs = [(f, a) for f, (a, _) in calls]
    replies = [_assistant("", _call_reasoning(rng, pairs) if _think(mode, 0.25, rng) else "", tool_calls), *results,
               _assistant(" ".join(answers), "The results are in; I report them." if _think(mode, 0.0, rng) else "")]
    return Exchange(user, replies, {"name": pairs[0][0].name, "arguments": pairs[0][1],
                                    "calls": [{"name": f.name, "arguments": a} for f, a in pairs]})


LOOKUP_SHARE = 0.45
"""Of the tool sets offered, the share made of lookup tools (training/lookup_tools.py), and as much again mixes
them with named families: names the model cannot have memorised, picked by the words of the request."""
CAMEL_SHARE = 0.25
"""Of the named families offered, the share renamed to camelCase: the same tool under a name not seen before."""


def toolset(rng: random.Random, n_extra: int | None = None) -> list[Family]:
    """1-4 families in random order, none twice (four tools' schemas keep a chat within a 1,280-token window):
    named families, lookup tools, or both."""
    from training.lookup_tools import lookup_toolset

    n = rng.choice((1, 2, 2, 3, 3, 4)) if n_extra is None else n_extra + 1
    x = rng.random()
    n_lookup = n if x < LOOKUP_SHARE else rng.randint(0, n) if x < 2 * LOOKUP_SHARE else 0
    picked = lookup_toolset(rng, n_lookup) if n_lookup else []
    names = {f.name for f in picked}
    for make in rng.sample(FAMILIES, len(FAMILIES)):
        if len(picked) >= n:
            break
        f = make(rng)
        if rng.random() < CAMEL_SHARE:
            f.spec = {**f.spec, "function": {**f.spec["function"], "name": camel(f.name)}}
        if f.name not in names:
            picked.append(f)
            names.add(f.name)
    rng.shuffle(picked)
    return picked


def _chat_of(rng: random.Random, kind: str, mode: str, ex: Exchange, fams: list[Family]) -> Chat:
    return _chat(rng, kind, mode, [ex], fams)  # type: ignore[arg-type]  (a Family has the .spec _chat reads)


def sample_request(rng: random.Random, src: Sources) -> Chat:
    """A request for one of the offered tools (one time in ten for two of them)."""
    mode = _pick_mode(rng, enabled=0.2, disabled=0.25)
    fams = toolset(rng)
    target = [rng.choice(fams)]
    if len(fams) > 1 and rng.random() < 0.1:
        target.append(rng.choice([f for f in fams if f is not target[0]]))
    return _chat_of(rng, "request", mode, request_exchange(rng, mode, fams, target), fams)


def unmatched_exchange(rng: random.Random, mode: str, fams: list[Family]) -> Exchange:
    """A request for what none of the offered `fams` does (another family's or lookup tool's request), phrased as a
    request that needs a call would be, and a reply that says no tool here does it: the request's words, not its
    being a request, decide whether to call."""
    from training.lookup_tools import lookup_family

    names, topics = {f.name for f in fams}, {f.topic for f in fams}
    for _ in range(50):
        other = rng.choice(FAMILIES)(rng) if rng.random() < 0.5 else lookup_family(rng)
        if other.name not in names and other.topic not in topics:
            break
    args, sents = other.ask(rng)
    user = phrase(rng, rng.choice(sents), values_of(args))
    listed = ", ".join(f.name for f in fams)
    reply = rng.choice((f"I can't do that here: none of the tools I have ({listed}) does it.",
                        f"None of the available tools ({listed}) can help with {other.topic}, so I can't do that.",
                        f"I have no tool for {other.topic}. The tools here are {listed}."))
    why = f"The user wants {other.topic}; none of {listed} does that, so I call nothing."
    return Exchange(user, [_assistant(reply, why if _think(mode, 0.3, rng) else "")], {"reply": reply})


# conversation that asks for nothing: (what is said, replies), the topic words filled in per message
CONVERSATION: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("thanks for that", "that was helpful", "much appreciated", "you've been a great help", "cheers for the help",
      "that's exactly what I needed"), ("You're welcome!", "Happy to help.", "Any time.")),
    (("I'm heading off now", "catch you later", "that's everything for today", "I'll be back tomorrow",
      "have a nice evening", "signing off"), ("Goodbye!", "Take care!", "See you next time.")),
    (("okay", "got it", "sounds good", "makes sense", "fair enough", "alright then", "perfect", "noted"),
     ("Let me know if you need anything else.", "Okay! Anything else I can do?")),
    (("I'm tired", "I had a long day", "I'm in a great mood today", "I'm a bit stressed about work",
      "I can't sleep", "I'm bored"), ("Thanks for telling me. Is there anything I can help with?",
                                      "I hear you. If there's something I can do, just ask.")),
    (("do you like {thing}", "what's your favourite kind of {thing}", "what do you think of {thing}",
      "is {thing} overrated"), ("I don't have tastes of my own, but I'm happy to help with a question.",
                                "I have no opinions about {thing}, I'm afraid. Anything I can help with?")),
    (("write a poem about {thing}", "tell me a story about {thing}", "make up a song about {thing}",
      "invent a riddle about {thing}"), ("I'm a very small model and can't write that well. I can answer short "
                                         "questions or use the tools here.",)),
)
THINGS = ("music", "coffee", "rainy weather", "chess", "old movies", "the sea", "mountains", "cats", "football",
          "spicy food", "winter", "trains")
OPENERS = ("", "", "", "Okay. ", "Alright, ", "Well, ", "Hmm, ", "By the way, ", "Honestly, ", "Oh, ")


def conversation_exchange(rng: random.Random, mode: str) -> Exchange:
    """A message that asks for nothing a tool or a fact could give - thanks, goodbyes, acknowledgements, moods,
    opinions, creative requests - and a short reply."""
    said, replies = rng.choice(CONVERSATION)
    thing = rng.choice(THINGS)
    body = rng.choice(said).format(thing=thing)
    text = rng.choice(OPENERS) + body
    text = text[:1].upper() + text[1:] + rng.choice(("", ".", "!", "?" if body.startswith(("do ", "what", "is "))
                                                     else "."))
    x = rng.random()  # typed as people type it: sometimes a typo, sometimes all lower case
    user = _typos(rng, text, [thing]) if x < 0.15 else text.lower() if x < 0.35 else text
    reply = rng.choice(replies).format(thing=thing)
    why = "Nothing to look up or compute here: I reply briefly."
    return Exchange(user, [_assistant(reply, why if _think(mode, 0.05, rng) else "")], {"reply": reply})


def sample_request_no_call(rng: random.Random, src: Sources) -> Chat:
    """The families' tools offered, a message none of them serves: the answer comes without a call. The message is
    arithmetic, a chat, a question it cannot know, a passage, a request for a tool that is not offered, or
    conversation."""
    from training import chats, honesty, passages

    mode = _pick_mode(rng, enabled=0.15, disabled=0.3)
    fams = toolset(rng)
    x = rng.random()
    ex = (chats._arith_exchange(rng, mode) if x < 0.15 else chats._chat_exchange(rng, mode, src) if x < 0.3
          else honesty.unknown_exchange(rng, mode) if x < 0.45 else passages.passage_exchange(rng, mode, src)
          if x < 0.6 else unmatched_exchange(rng, mode, fams) if x < 0.8 else conversation_exchange(rng, mode))
    ex.expected["calls"] = []
    return _chat_of(rng, "request_no_call", mode, ex, fams)
