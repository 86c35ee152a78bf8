"""Write the held-out set (requests.jsonl.gz, documents.jsonl.gz) from its own generator.

    python -m nanoserve.bench.heldout.build [--out nanoserve/bench/heldout]

Deterministic (one seed). Written apart from the training generator on purpose: its tool families (apps a user
might plug in: markets, home automation, dining, fitness, logistics, ...), its request templates, its names and
places, its retrieval filler and needles (lockers and their combinations, not pass keys) and its glossary (words
invented here, so no model can know them by heart) are its own. What each task asks:

    tool_call     one request in the user's own words for one of the app's 3-4 tools (the rest are distractors);
                  values said as people say them ("for 2", "12 miles", "twenty minutes", "make sure it's locked")
    no_call       the same apps' tools offered, a request that needs none of them
    tool_result   a call was made and its result fed back: the answer must use the result, and call nothing
    passage       a glossary (invented words) or library reference entries (the stdlib's own docstrings, read
                  with inspect) in the prompt, a question about one entry: the answer must hold its gold span
    arith         2-3 digit sums and differences in its own phrasings, thinking enabled or disabled
    out_of_scope  questions no small offline model can answer (live data, the user's private facts, obscure
                  facts): the answer must say so
    retrieval_Nk  a locker's combination among ~40 in N thousand tokens of notes, several questions per document

The documents are sized with m3-mini's tokenizer so a 16k prompt fits its 16,384-token context.
"""

from __future__ import annotations

import argparse
import gzip
import inspect
import json
import os
import random
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from nanoserve.bench.heldout import DOCUMENT, HERE

SEED = 20261207

# -- the generator's own vocabulary --------------------------------------------------------------------------------
TOWNS = ("Ghent", "Utrecht", "Bilbao", "Tartu", "Kaunas", "Graz", "Lund", "Aarhus", "Bruges", "Salzburg", "Turku",
         "Malmo", "Basel", "Trieste", "Cork", "Galway", "Leeds", "Nantes", "Leipzig", "Bologna", "Gdansk", "Brno",
         "Ljubljana", "Split", "Plovdiv", "Cluj", "Tampere", "Uppsala", "Odense", "Linz")
PEOPLE = ("Ansel", "Brigid", "Cosima", "Dario", "Elif", "Fenna", "Gideon", "Halvard", "Isolde", "Jarrah",
          "Kasimir", "Linnea", "Magnus", "Nerys", "Orla", "Piet", "Rune", "Saskia", "Tobias", "Ulla", "Viggo", "Wren",
          "Ximena", "Yannick", "Zelda")
SURNAMES = ("Abernathy", "Brandvold", "Castellanos", "Driscoll", "Eberhardt", "Fairweather", "Gallagher",
            "Holmqvist", "Ignatiev", "Jablonski", "Kowalczyk", "Lindholm", "Marchetti", "Nakamura", "Oyelaran")
TICKERS = ("TSLA", "AAPL", "NVDA", "MSFT", "AMZN", "SAP", "ASML", "SONY", "NFLX", "INTC", "ORCL", "SHOP")
CURRENCIES = ("EUR", "USD", "GBP", "JPY", "CHF", "SEK", "NOK", "PLN")
CUISINES = ("Georgian", "Ethiopian", "Peruvian", "Sichuan", "Lebanese", "Basque", "Keralan", "Oaxacan")
VENUES = ("The Copper Kettle", "Saffron Yard", "Blue Heron Bistro", "Olive and Ash", "Little Lantern",
          "Harbour Table", "The Gilded Fig", "Northern Hearth")
DISHES = ("falafel wrap", "margherita pizza", "pad thai", "lentil soup", "chicken shawarma", "veggie burger",
          "miso ramen", "caesar salad")
SHOWS = ("Deep Field Radio", "The Slow Kitchen", "Byte Sized History", "Weekend Wanderer", "Market Pulse Daily")
BOOKS = (("The Salt Road", "Mara Lindqvist"), ("Glass Orchards", "Teo Albescu"),
         ("A Map of Small Rivers", "June Okoro"), ("The Clockmaker's Dog", "Ilse Brandt"),
         ("Quiet Engines", "Ravi Menon"), ("Winter at Kestrel Point", "Ada Fenn"))
STATIONS = ("Ghent-Sint-Pieters", "Utrecht Centraal", "Leipzig Hbf", "Graz Hbf", "Basel SBB", "Bologna Centrale",
            "Salzburg Hbf", "Brno hlavni", "Linz Hbf", "Lund C")
SPECIES = ("monstera", "fiddle leaf fig", "snake plant", "basil", "lemon tree", "peace lily", "aloe vera")
PET_KINDS = ("dog", "cat", "rabbit", "bird")
PET_NAMES = ("Biscuit", "Pepper", "Noodle", "Juniper", "Mochi", "Tansy", "Clover", "Pickle")
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 10: "ten",
                12: "twelve", 15: "fifteen", 20: "twenty", 30: "thirty", 45: "forty-five"}


def _email(rng: random.Random) -> str:
    return f"{rng.choice(PEOPLE).lower()}.{rng.choice(SURNAMES).lower()}@lumen-works.org"


def _day(rng: random.Random) -> tuple[str, str]:
    """(ISO date, how a user says it)."""
    m, d = rng.randint(1, 12), rng.randint(1, 28)
    months = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
              "November", "December")
    iso = f"2027-{m:02d}-{d:02d}"
    said = rng.choice((iso, f"{months[m - 1]} {d}, 2027", f"{d} {months[m - 1]} 2027"))
    return iso, said


def _clock(rng: random.Random) -> tuple[str, str]:
    """(HH:MM, how a user says it)."""
    h, mm = rng.randint(7, 21), rng.choice((0, 15, 30, 45))
    hhmm = f"{h:02d}:{mm:02d}"
    twelve = f"{(h - 1) % 12 + 1}{':' + format(mm, '02d') if mm else ''} {'am' if h < 12 else 'pm'}"
    return hhmm, rng.choice((hhmm, twelve, twelve.replace(" ", "")))


def _amount(rng: random.Random, lo: int, hi: int) -> float:
    cents = rng.choice((0, 0, 25, 50, 75, 99, 40))
    return round(rng.randint(lo, hi) + cents / 100, 2)


def _money(x: float) -> str:
    return f"{x:.2f}" if x != int(x) else str(int(x))


def _count(rng: random.Random, n: int) -> str:
    """A small count, in digits or in words."""
    return NUMBER_WORDS[n] if n in NUMBER_WORDS and rng.random() < 0.45 else str(n)


# -- the tool families ---------------------------------------------------------------------------------------------
@dataclass
class Tool:
    """One function tool: its OpenAI spec, how a request for it is drawn (arguments, the user's sentences) and the
    result it returns (the result JSON and the values an answer reporting it must hold)."""

    spec: dict
    ask: Callable[[random.Random], tuple[dict, list[str]]]
    result: Callable[[random.Random, dict], tuple[dict, list[str]]]

    @property
    def name(self) -> str:
        return self.spec["function"]["name"]


def fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def _equity_quote() -> Tool:
    spec = fn("equity_quote", "Latest trading price of a listed company's shares, by ticker symbol.",
              {"symbol": {"type": "string", "description": "Ticker symbol, e.g. NVDA"}}, ["symbol"])

    def ask(r):
        s = r.choice(TICKERS)
        return {"symbol": s}, [f"What's the stock price of {s}?", f"how much is {s} trading at right now",
                               f"Give me the current share price for {s}.", f"Is {s} up today? What's it at?",
                               f"Quote for {s} please", f"I'm curious what {s} shares cost at the moment."]

    def result(r, a):
        p = _amount(r, 20, 900)
        return {"symbol": a["symbol"], "price": p, "currency": "USD"}, [_money(p)]
    return Tool(spec, ask, result)


def _fx_rate() -> Tool:
    spec = fn("fx_rate", "Exchange rate between two currencies (ISO 4217 codes).",
              {"base": {"type": "string"}, "quote": {"type": "string"}}, ["base", "quote"])

    def ask(r):
        a, b = r.sample(CURRENCIES, 2)
        return {"base": a, "quote": b}, [f"How many {b} do I get for one {a}?", f"What's the {a} to {b} rate today?",
                                         f"Exchange rate {a}/{b}?", f"convert rate from {a} into {b} pls"]

    def result(r, a):
        x = round(r.uniform(0.1, 150), 4)
        return {"base": a["base"], "quote": a["quote"], "rate": x}, [str(x)]
    return Tool(spec, ask, result)


def _portfolio_positions() -> Tool:
    spec = fn("portfolio_positions", "List the holdings in a brokerage account.",
              {"account_number": {"type": "string"},
               "include_closed": {"type": "boolean", "default": False,
                                  "description": "Also list positions that were sold."}}, ["account_number"])

    def ask(r):
        acct = f"BRK-{r.randint(10000, 99999)}"
        if r.random() < 0.5:
            return {"account_number": acct, "include_closed": True}, [
                f"Show everything in account {acct}, including the positions I already closed.",
                f"List all holdings for {acct} - closed ones too."]
        return {"account_number": acct}, [f"What do I currently hold in account {acct}?",
                                          f"Show me the positions in my brokerage account {acct}."]

    def result(r, a):
        n = r.randint(2, 9)
        return {"account_number": a["account_number"], "positions": n}, [str(n)]
    return Tool(spec, ask, result)


UNITS = {"km": ("km", "kilometers", "kilometres"), "mi": ("miles", "mi", "miles"), "kg": ("kg", "kilograms", "kilos"),
         "lb": ("pounds", "lb", "lbs"), "l": ("liters", "litres", "l"), "gal": ("gallons", "gal", "gallons")}
PAIRS = (("km", "mi"), ("mi", "km"), ("kg", "lb"), ("lb", "kg"), ("l", "gal"), ("gal", "l"))


def _measure_convert() -> Tool:
    units = ["km", "mi", "kg", "lb", "l", "gal"]
    spec = fn("measure_convert", "Convert a quantity between units of length, mass or volume.",
              {"quantity": {"type": "number"}, "source": {"type": "string", "enum": units},
               "target": {"type": "string", "enum": units}}, ["quantity", "source", "target"])

    def ask(r):
        src, dst = r.choice(PAIRS)
        q = r.choice((r.randint(2, 500), round(r.uniform(1, 99), 1)))
        s, d = r.choice(UNITS[src]), r.choice(UNITS[dst])
        qs = str(q)
        return {"quantity": q, "source": src, "target": dst}, [
            f"How many {d} is {qs} {s}?", f"Convert {qs} {s} to {d}.", f"{qs} {s} in {d}?",
            f"I ran {qs} {s} this morning - what is that in {d}?" if src in ("km", "mi") else
            f"The recipe says {qs} {s}; how much is that in {d}?"]

    def result(r, a):
        v = round(r.uniform(1, 900), 2)
        return {"value": v, "unit": a["target"]}, [str(v)]
    return Tool(spec, ask, result)


def _tip_split() -> Tool:
    spec = fn("tip_split", "Split a restaurant bill between diners, tip included.",
              {"bill_total": {"type": "number"}, "diners": {"type": "integer", "minimum": 1},
               "tip_percent": {"type": "integer", "default": 15}}, ["bill_total", "diners"])

    def ask(r):
        total, n = _amount(r, 20, 400), r.choice((2, 3, 4, 5, 6))
        args: dict[str, Any] = {"bill_total": total, "diners": n}
        tip = ""
        if r.random() < 0.5:
            args["tip_percent"] = r.choice((10, 18, 20, 25))
            tip = f" with a {args['tip_percent']}% tip"
        return args, [f"Dinner came to ${_money(total)} for {_count(r, n)} of us{tip}. What does each person owe?",
                      f"Split {_money(total)} between {_count(r, n)} people{tip}.",
                      f"we're {_count(r, n)} friends and the bill is {_money(total)} dollars{tip}, how much each?"]

    def result(r, a):
        each = round(a["bill_total"] * (1 + a.get("tip_percent", 15) / 100) / a["diners"], 2)
        return {"per_person": each}, [_money(each)]
    return Tool(spec, ask, result)


def _loan_payment() -> Tool:
    spec = fn("loan_payment", "Monthly payment of a fixed-rate loan.",
              {"principal": {"type": "number"}, "annual_rate": {"type": "number", "description": "Percent per year"},
               "years": {"type": "integer"}}, ["principal", "annual_rate", "years"])

    def ask(r):
        p, rate, y = r.choice((5000, 12000, 25000, 180000, 320000)), r.choice((3.5, 4.2, 5.9, 7.25)), \
            r.choice((3, 5, 10, 15, 30))
        return {"principal": p, "annual_rate": rate, "years": y}, [
            f"What would my monthly payment be on a {p} loan at {rate}% over {y} years?",
            f"Borrowing {p} for {_count(r, y) if y in NUMBER_WORDS else y} years at {rate} percent - monthly cost?"]

    def result(r, a):
        m = _amount(r, 90, 2500)
        return {"monthly_payment": m}, [_money(m)]
    return Tool(spec, ask, result)


def _thermostat_target() -> Tool:
    zones = ["living_room", "bedroom", "office", "kitchen"]
    spec = fn("thermostat_target", "Set the target temperature (Celsius) of a heating zone.",
              {"zone": {"type": "string", "enum": zones}, "degrees": {"type": "number"},
               "hold": {"type": "boolean", "description": "Keep this temperature until changed."}},
              ["zone", "degrees"])

    def ask(r):
        z, t = r.choice(zones), r.choice((18, 19, 20, 21, 22, 23, 19.5, 21.5))
        room = z.replace("_", " ")
        args: dict[str, Any] = {"zone": z, "degrees": t}
        extra = ""
        if r.random() < 0.4:
            args["hold"] = True
            extra = r.choice((" and keep it there", " and hold it until I change it"))
        return args, [f"Set the {room} to {t} degrees{extra}.", f"Can you make the {room} {t}°C{extra}?",
                      f"It's chilly in the {room}; warm it up to {t} degrees{extra}, please."]

    def result(r, a):
        return {"zone": a["zone"], "target": a["degrees"], "status": "applied"}, [str(a["degrees"])]
    return Tool(spec, ask, result)


def _lights_scene() -> Tool:
    spec = fn("lights_scene", "Change the lights in a room.",
              {"room": {"type": "string"}, "brightness": {"type": "integer", "minimum": 0, "maximum": 100},
               "color": {"type": "string", "enum": ["warm", "cool", "daylight"]}}, ["room", "brightness"])

    def ask(r):
        room, b = r.choice(("hallway", "study", "porch", "nursery", "den")), r.choice((10, 25, 40, 60, 80, 100))
        args: dict[str, Any] = {"room": room, "brightness": b}
        col = ""
        if r.random() < 0.5:
            args["color"] = r.choice(("warm", "cool", "daylight"))
            col = f" {args['color']}"
        return args, [f"Dim the {room} lights to {b}%{', ' + col.strip() + ' white' if col else ''}.",
                      f"Put the {room} at {b} percent brightness{' with' + col + ' light' if col else ''}.",
                      f"Could you set the{col} lights in the {room} to {b}?"]

    def result(r, a):
        return {"room": a["room"], "brightness": a["brightness"], "ok": True}, [str(a["brightness"])]
    return Tool(spec, ask, result)


def _door_lock_state() -> Tool:
    spec = fn("door_lock_state", "Lock or unlock a door of the house.",
              {"door": {"type": "string", "enum": ["front", "back", "garage"]}, "locked": {"type": "boolean"}},
              ["door", "locked"])

    def ask(r):
        door, lock = r.choice(("front", "back", "garage")), r.random() < 0.6
        if lock:
            return {"door": door, "locked": True}, [f"Lock the {door} door.", f"Did I leave the {door} door open? "
                                                    f"Make sure it's locked.", f"please secure the {door} door"]
        return {"door": door, "locked": False}, [f"Unlock the {door} door for the plumber.",
                                                 f"Let me in - open the {door} door lock."]

    def result(r, a):
        return {"door": a["door"], "locked": a["locked"]}, ["locked" if a["locked"] else "unlocked"]
    return Tool(spec, ask, result)


def _table_booking() -> Tool:
    spec = fn("table_booking", "Reserve a table at a restaurant.",
              {"venue": {"type": "string"}, "party_size": {"type": "integer"},
               "date": {"type": "string", "description": "YYYY-MM-DD"},
               "time": {"type": "string", "description": "HH:MM, 24-hour"},
               "seating": {"type": "string", "enum": ["indoor", "outdoor"]}}, ["venue", "party_size", "date", "time"])

    def ask(r):
        v, n = r.choice(VENUES), r.choice((2, 3, 4, 6, 8))
        iso, said_day = _day(r)
        hhmm, said_time = _clock(r)
        args: dict[str, Any] = {"venue": v, "party_size": n, "date": iso, "time": hhmm}
        out = ""
        if r.random() < 0.35:
            args["seating"] = r.choice(("indoor", "outdoor"))
            out = " on the terrace" if args["seating"] == "outdoor" else " inside"
        return args, [f"Book a table at {v} for {_count(r, n)} on {said_day} at {said_time}{out}.",
                      f"Can I get a reservation at {v}, {said_day}, {said_time}, party of {n}{out}?",
                      f"My parents are visiting. Please reserve {v} for {_count(r, n)} people at {said_time} "
                      f"on {said_day}{out}."]

    def result(r, a):
        code = f"R{r.randint(1000, 9999)}"
        return {"confirmation": code, "venue": a["venue"]}, [code]
    return Tool(spec, ask, result)


def _menu_search() -> Tool:
    diets = ["vegan", "vegetarian", "gluten_free", "halal"]
    spec = fn("menu_search", "Find restaurants by cuisine, price and dietary needs.",
              {"cuisine": {"type": "string"}, "max_price": {"type": "number"},
               "dietary": {"type": "array", "items": {"type": "string", "enum": diets}}}, ["cuisine"])

    def ask(r):
        c = r.choice(CUISINES)
        args: dict[str, Any] = {"cuisine": c}
        bits = []
        if r.random() < 0.5:
            args["max_price"] = r.choice((15, 20, 30, 45))
            bits.append(f"under ${args['max_price']}")
        if r.random() < 0.6:
            args["dietary"] = r.sample(diets, r.choice((1, 2)))
            bits.append("that is " + " and ".join(d.replace("_", "-") for d in args["dietary"]))
        tail = (" " + " ".join(bits)) if bits else ""
        return args, [f"Find me a {c} place{tail}.", f"Any good {c} restaurants{tail}?",
                      f"I'm craving {c} food tonight - something{tail}."]

    def result(r, a):
        v = r.choice(VENUES)
        return {"results": [v]}, [v]
    return Tool(spec, ask, result)


def _order_delivery() -> Tool:
    spec = fn("order_delivery", "Order food for delivery.",
              {"items": {"type": "array", "items": {"type": "object", "properties": {
                  "dish": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["dish", "qty"]}},
               "address": {"type": "string"}}, ["items", "address"])

    def ask(r):
        dishes = r.sample(DISHES, r.choice((1, 2)))
        items = [{"dish": d, "qty": r.choice((1, 2, 3))} for d in dishes]
        addr = f"{r.randint(2, 180)} {r.choice(('Linden', 'Harbour', 'Mill', 'Orchard'))} Street"
        said = " and ".join(f"{_count(r, i['qty']) if i['qty'] > 1 else 'one'} {i['dish']}" for i in items)
        return {"items": items, "address": addr}, [f"Order {said} to {addr}.",
                                                   f"Can you get {said} delivered to {addr}?",
                                                   f"I'm at {addr} and hungry: {said}, please."]

    def result(r, a):
        eta = r.choice((20, 25, 35, 40))
        return {"eta_minutes": eta, "status": "placed"}, [str(eta)]
    return Tool(spec, ask, result)


def _log_workout() -> Tool:
    spec = fn("log_workout", "Record a workout in the training diary.",
              {"activity": {"type": "string", "enum": ["run", "swim", "cycle", "row", "walk"]},
               "distance": {"type": "object", "properties": {"value": {"type": "number"},
                                                              "unit": {"type": "string", "enum": ["km", "mi"]}},
                            "required": ["value", "unit"]},
               "minutes": {"type": "integer"}}, ["activity", "distance"])

    def ask(r):
        act = r.choice(("run", "swim", "cycle", "row", "walk"))
        unit = r.choice(("km", "mi"))
        v = r.choice((2, 3, 5, 8, 10, 12, 21, 4.5, 6.2))
        verb = {"run": "ran", "swim": "swam", "cycle": "cycled", "row": "rowed", "walk": "walked"}[act]
        args: dict[str, Any] = {"activity": act, "distance": {"value": v, "unit": unit}}
        tm = ""
        if r.random() < 0.5:
            args["minutes"] = r.choice((20, 30, 45, 55, 75))
            tm = f" in {_count(r, args['minutes'])} minutes"
        u = r.choice(UNITS[unit])
        return args, [f"Log it: I {verb} {v} {u}{tm} today.", f"I just {verb} {v} {u}{tm}. Save that workout.",
                      f"add a {act} of {v} {u}{tm} to my diary"]

    def result(r, a):
        total = round(r.uniform(20, 300), 1)
        return {"saved": True, "week_total": total}, [str(total)]
    return Tool(spec, ask, result)


def _heart_rate_zones() -> Tool:
    spec = fn("heart_rate_zones", "Training heart-rate zones from age and resting pulse.",
              {"age": {"type": "integer"}, "resting_bpm": {"type": "integer"}}, ["age", "resting_bpm"])

    def ask(r):
        age, bpm = r.randint(18, 70), r.randint(45, 80)
        return {"age": age, "resting_bpm": bpm}, [
            f"I'm {age} and my resting heart rate is {bpm}. What are my training zones?",
            f"Heart rate zones for a {age}-year-old with a resting pulse of {bpm} bpm?"]

    def result(r, a):
        mx = 220 - a["age"]
        return {"max_bpm": mx, "zone2": [int(mx * 0.6), int(mx * 0.7)]}, [str(mx)]
    return Tool(spec, ask, result)


def _step_total() -> Tool:
    spec = fn("step_total", "Steps counted on a given day.", {"date": {"type": "string", "description": "YYYY-MM-DD"}},
              ["date"])

    def ask(r):
        iso, said = _day(r)
        return {"date": iso}, [f"How many steps did I take on {said}?", f"Step count for {said}?"]

    def result(r, a):
        n = r.randint(1500, 22000)
        return {"date": a["date"], "steps": n}, [str(n)]
    return Tool(spec, ask, result)


def _parcel_status() -> Tool:
    spec = fn("parcel_status", "Where a parcel is, by tracking code.",
              {"tracking_code": {"type": "string"},
               "carrier": {"type": "string", "enum": ["dhl", "ups", "fedex", "usps"]}}, ["tracking_code"])

    def ask(r):
        code = f"{r.choice(('JJD', '1Z', 'LX', '92'))}{r.randint(10**7, 10**8 - 1)}"
        args: dict[str, Any] = {"tracking_code": code}
        car = ""
        if r.random() < 0.5:
            args["carrier"] = r.choice(("dhl", "ups", "fedex", "usps"))
            car = f" ({args['carrier'].upper()})"
        return args, [f"Where is my package {code}{car}?", f"Track {code}{car} for me.",
                      f"My order hasn't arrived. The tracking number is {code}{car} - any news?"]

    def result(r, a):
        town = r.choice(TOWNS)
        return {"status": "in transit", "last_scan": town}, [town]
    return Tool(spec, ask, result)


def _freight_quote() -> Tool:
    spec = fn("freight_quote", "Price to ship a box between two postcodes.",
              {"weight_kg": {"type": "number"}, "origin_zip": {"type": "string"},
               "destination_zip": {"type": "string"}, "fragile": {"type": "boolean", "default": False}},
              ["weight_kg", "origin_zip", "destination_zip"])

    def ask(r):
        w, a, b = r.choice((1.5, 3, 7, 12, 20.5)), str(r.randint(10000, 99999)), str(r.randint(10000, 99999))
        args: dict[str, Any] = {"weight_kg": w, "origin_zip": a, "destination_zip": b}
        fr = ""
        if r.random() < 0.4:
            args["fragile"] = True
            fr = r.choice((" It's glassware, so fragile.", " Handle with care - it's fragile."))
        return args, [f"How much to send a {w} kg box from {a} to {b}?{fr}",
                      f"Quote me shipping for {w} kilos, {a} -> {b}.{fr}"]

    def result(r, a):
        p = _amount(r, 8, 120)
        return {"price": p, "currency": "EUR"}, [_money(p)]
    return Tool(spec, ask, result)


def _calendar_slot() -> Tool:
    spec = fn("calendar_slot", "Find a free meeting slot for a group.",
              {"attendees": {"type": "array", "items": {"type": "string"}, "description": "Email addresses"},
               "duration_minutes": {"type": "integer"}, "earliest": {"type": "string", "description": "YYYY-MM-DD"}},
              ["attendees", "duration_minutes"])

    def ask(r):
        people = [_email(r) for _ in range(r.choice((1, 2, 3)))]
        mins = r.choice((15, 30, 45, 60, 90))
        args: dict[str, Any] = {"attendees": people, "duration_minutes": mins}
        when = ""
        if r.random() < 0.4:
            iso, said = _day(r)
            args["earliest"] = iso
            when = f", no earlier than {said}"
        who = ", ".join(people[:-1]) + (" and " if len(people) > 1 else "") + people[-1]
        dur = "an hour" if mins == 60 else f"{_count(r, mins)} minutes"
        return args, [f"Find {dur} when {who} are free{when}.",
                      f"I need a {mins}-minute slot with {who}{when}.",
                      f"When can I meet {who} for {dur}{when}?"]

    def result(r, a):
        iso, _ = _day(r)
        return {"start": f"{iso}T10:00"}, [iso]
    return Tool(spec, ask, result)


def _expense_claim() -> Tool:
    spec = fn("expense_claim", "File an expense for reimbursement.",
              {"amount": {"type": "number"}, "currency": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"]},
               "category": {"type": "string", "enum": ["travel", "meals", "lodging", "supplies"]},
               "note": {"type": "string"}}, ["amount", "currency", "category"])

    def ask(r):
        amt = _amount(r, 5, 600)
        cur = r.choice(("EUR", "USD", "GBP"))
        cat = r.choice(("travel", "meals", "lodging", "supplies"))
        sign = {"EUR": "€", "USD": "$", "GBP": "£"}[cur]
        args = {"amount": amt, "currency": cur, "category": cat}
        return args, [f"Claim {sign}{_money(amt)} for {cat}.", f"File a {cat} expense of {_money(amt)} {cur}.",
                      f"I paid {_money(amt)} {cur} on {cat} during the trip; submit it for reimbursement."]

    def result(r, a):
        cid = f"EXP-{r.randint(100, 999)}"
        return {"claim_id": cid, "state": "submitted"}, [cid]
    return Tool(spec, ask, result)


def _vacation_balance() -> Tool:
    spec = fn("vacation_balance", "Days of paid leave an employee has left.",
              {"employee_id": {"type": "string"}}, ["employee_id"])

    def ask(r):
        e = f"E{r.randint(1000, 9999)}"
        return {"employee_id": e}, [f"How many vacation days does {e} have left?",
                                    f"Leave balance for employee {e}?"]

    def result(r, a):
        d = r.randint(0, 30)
        return {"days_left": d}, [str(d)]
    return Tool(spec, ask, result)


def _catalog_lookup() -> Tool:
    spec = fn("catalog_lookup", "Search the library catalogue.",
              {"title": {"type": "string"}, "author": {"type": "string"},
               "format": {"type": "string", "enum": ["ebook", "audiobook", "print"]}}, ["title"])

    def ask(r):
        t, a = r.choice(BOOKS)
        args: dict[str, Any] = {"title": t}
        if r.random() < 0.4:
            args["author"] = a
        fmt = ""
        if r.random() < 0.5:
            args["format"] = r.choice(("ebook", "audiobook", "print"))
            fmt = {"ebook": " as an e-book", "audiobook": " as an audiobook", "print": " in print"}[args["format"]]
        by = f" by {a}" if "author" in args else ""
        return args, [f"Does the library have {t}{by}{fmt}?", f"Look for \"{t}\"{by}{fmt} in the catalogue.",
                      f"I'd like to borrow {t}{by}{fmt}."]

    def result(r, a):
        n = r.randint(0, 4)
        return {"available_copies": n}, [str(n)]
    return Tool(spec, ask, result)


def _podcast_episodes() -> Tool:
    spec = fn("podcast_episodes", "Recent episodes of a podcast.",
              {"show": {"type": "string"}, "latest": {"type": "integer", "default": 5}}, ["show"])

    def ask(r):
        s = r.choice(SHOWS)
        if r.random() < 0.5:
            n = r.choice((2, 3, 10))
            return {"show": s, "latest": n}, [f"What are the last {_count(r, n)} episodes of {s}?",
                                              f"Show me {s}'s {n} newest episodes."]
        return {"show": s}, [f"Any new episodes of {s}?", f"What's been released lately on {s}?"]

    def result(r, a):
        title = f"Episode {r.randint(40, 300)}"
        return {"episodes": [title]}, [title]
    return Tool(spec, ask, result)


def _plant_watering() -> Tool:
    spec = fn("plant_watering_schedule", "How often and how much to water a plant.",
              {"species": {"type": "string"}, "pot_liters": {"type": "number"}, "indoor": {"type": "boolean"}},
              ["species", "pot_liters", "indoor"])

    def ask(r):
        s, pot, indoor = r.choice(SPECIES), r.choice((1, 2.5, 5, 10, 20)), r.random() < 0.6
        where = r.choice(("indoors", "inside", "in the living room")) if indoor else \
            r.choice(("outdoors", "on the balcony", "in the garden"))
        return {"species": s, "pot_liters": pot, "indoor": indoor}, [
            f"How should I water a {s} in a {pot} liter pot {where}?",
            f"My {s} lives {where} in a {pot}L pot. Watering schedule?"]

    def result(r, a):
        d = r.randint(2, 14)
        return {"every_days": d}, [str(d)]
    return Tool(spec, ask, result)


def _vet_visit() -> Tool:
    spec = fn("vet_visit", "Book an appointment at the vet.",
              {"pet_name": {"type": "string"}, "species": {"type": "string", "enum": list(PET_KINDS)},
               "reason": {"type": "string"}}, ["pet_name", "species", "reason"])

    def ask(r):
        n, s = r.choice(PET_NAMES), r.choice(PET_KINDS)
        reason = r.choice(("vaccination", "limping", "dental check", "not eating"))
        return {"pet_name": n, "species": s, "reason": reason}, [
            f"Book the vet for my {s} {n}, reason: {reason}.",
            f"{n} (my {s}) needs to see a vet for a {reason}." if reason in ("vaccination", "dental check") else
            f"My {s} {n} is {reason}; get an appointment with the vet (reason: {reason})."]

    def result(r, a):
        hhmm, _ = _clock(r)
        return {"slot": hhmm}, [hhmm]
    return Tool(spec, ask, result)


def _train_times() -> Tool:
    spec = fn("train_times", "Departures between two stations.",
              {"from_station": {"type": "string"}, "to_station": {"type": "string"},
               "depart_after": {"type": "string", "description": "HH:MM"},
               "max_changes": {"type": "integer", "default": 2}}, ["from_station", "to_station"])

    def ask(r):
        a, b = r.sample(STATIONS, 2)
        args: dict[str, Any] = {"from_station": a, "to_station": b}
        when = ""
        if r.random() < 0.5:
            hhmm, said = _clock(r)
            args["depart_after"] = hhmm
            when = f" after {said}"
        direct = ""
        if r.random() < 0.3:
            args["max_changes"] = 0
            direct = r.choice((", direct only", " with no changes"))
        return args, [f"Trains from {a} to {b}{when}{direct}?", f"When can I get from {a} to {b}{when}{direct}?",
                      f"I need to be in {b} tonight. What leaves {a}{when}{direct}?"]

    def result(r, a):
        hhmm, _ = _clock(r)
        return {"departures": [hhmm]}, [hhmm]
    return Tool(spec, ask, result)


APPS: dict[str, list[Callable[[], Tool]]] = {
    "markets": [_equity_quote, _fx_rate, _portfolio_positions],
    "calculators": [_measure_convert, _tip_split, _loan_payment],
    "home": [_thermostat_target, _lights_scene, _door_lock_state],
    "dining": [_table_booking, _menu_search, _order_delivery],
    "fitness": [_log_workout, _heart_rate_zones, _step_total],
    "logistics": [_parcel_status, _freight_quote, _train_times],
    "workplace": [_calendar_slot, _expense_claim, _vacation_balance],
    "leisure": [_catalog_lookup, _podcast_episodes, _plant_watering, _vet_visit],
}

# -- how people phrase things --------------------------------------------------------------------------------------
CONTEXT = ("Quick one.", "Morning!", "Sorry to bother you again.", "I'm on my phone so keeping this short.",
           "Long day here.", "Okay, next thing.", "Hope you can help with this.", "So,")
INDIRECT = ("I was wondering: {s}", "Would you mind helping? {s}", "If it's not too much trouble - {s}",
            "My colleague asked me this and I have no idea: {s}", "{s} Thanks a lot!", "{s} Cheers.")


def _typo(rng: random.Random, text: str, protect: list[str]) -> str:
    """One or two swapped letters in words that carry no value."""
    words = text.split(" ")
    safe = [i for i, w in enumerate(words) if len(w) > 4 and w.isalpha() and not any(w in p or p in w for p in protect)]
    for i in rng.sample(safe, min(len(safe), rng.choice((1, 2)))):
        w = words[i]
        j = rng.randrange(1, len(w) - 2)
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def styled(rng: random.Random, sentence: str, values: list[str]) -> str:
    """The request as a user types it: plain, with a line of context before, indirect, with typos, or lower case
    without its final punctuation."""
    x = rng.random()
    if x < 0.3:
        return sentence
    if x < 0.5:
        return f"{rng.choice(CONTEXT)} {sentence}"
    if x < 0.7:
        s = sentence[0].lower() + sentence[1:] if rng.random() < 0.5 else sentence
        return rng.choice(INDIRECT).format(s=s)
    if x < 0.85:
        return _typo(rng, sentence, values)
    return sentence.rstrip(".?!").lower() if not any(v != v.lower() for v in values) else sentence.rstrip(".?!")


def _values(args: Any) -> list[str]:
    if isinstance(args, dict):
        return [s for v in args.values() for s in _values(v)]
    if isinstance(args, list):
        return [s for v in args for s in _values(v)]
    return [str(args)]


# -- tasks ---------------------------------------------------------------------------------------------------------
def _mode(rng: random.Random) -> str | None:
    x = rng.random()
    return None if x < 0.5 else "disabled" if x < 0.75 else "enabled"


def tool_rows(rng: random.Random, per_tool: int) -> list[dict]:
    rows = []
    for app, makers in APPS.items():
        tools = [m() for m in makers]
        specs = [t.spec for t in tools]
        for t in tools:
            for _ in range(per_tool):
                args, sentences = t.ask(rng)
                request = styled(rng, rng.choice(sentences), _values(args))
                rows.append({"task": "tool_call", "app": app, "messages": [{"role": "user", "content": request}],
                             "tools": specs, "thinking_mode": _mode(rng), "request": request,
                             "expected": {"name": t.name, "arguments": args}})
    return rows


NO_CALL = ("Thanks, that's all for now!", "Hi there, how's it going?", "47 and 38 added together?",
           "Tell me a fun fact.", "Who made you?", "Can you explain what you are able to do?", "What's 230 minus 75?",
           "ok never mind, forget it", "Good night!", "What does the word 'ephemeral' mean?",
           "How do you spell necessary?", "Which is bigger, 412 or 398?")


def no_call_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    apps = list(APPS.items())
    for i in range(n):
        app, makers = apps[i % len(apps)]
        specs = [m().spec for m in makers]
        request = styled(rng, NO_CALL[i % len(NO_CALL)], [])
        rows.append({"task": "no_call", "app": app, "messages": [{"role": "user", "content": request}],
                     "tools": specs, "thinking_mode": _mode(rng), "request": request, "expected": {}})
    return rows


def result_rows(rng: random.Random, per_app: int) -> list[dict]:
    rows = []
    for app, makers in APPS.items():
        tools = [m() for m in makers]
        for _ in range(per_app):
            t = rng.choice(tools)
            args, sentences = t.ask(rng)
            request = rng.choice(sentences)
            res, gold = t.result(rng, args)
            cid = f"call_{rng.getrandbits(64):016x}"
            call = {"id": cid, "type": "function", "function": {"name": t.name, "arguments": json.dumps(args)}}
            messages = [{"role": "user", "content": request},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": cid, "content": json.dumps(res)}]
            rows.append({"task": "tool_result", "app": app, "messages": messages, "tools": [x.spec for x in tools],
                         "thinking_mode": rng.choice((None, "disabled")), "request": request,
                         "expected": {"contains": gold}})
    return rows


# a glossary of words made up here: no model knows them, so an answer can only come from the passage
GLOSSARY = (
    ("quillmarsh", "a wetland where reeds grow thick enough to walk on"),
    ("tavelite", "a pale green stone that glows faintly after sunset"),
    ("brindlock", "a wooden latch that opens only when lifted and turned"),
    ("morrowfish", "a small river fish that swims upstream at dawn"),
    ("cindervane", "a weathervane made from melted scrap iron"),
    ("hollowmere", "a lake that fills only in the rainy season"),
    ("sprocketeer", "a repairer of bicycle chains and gears"),
    ("glimmerwort", "a herb whose leaves turn silver in frost"),
    ("tallowgate", "a narrow alley where candle makers worked"),
    ("fennick", "a pocket knife with a folding spoon"),
    ("orbling", "a child's toy made of nested wooden spheres"),
    ("drumlace", "a cord used to tighten the skin of a drum"),
    ("saltwhistle", "a kettle that whistles when sea water boils"),
    ("pellorin", "a shared garden tended by a whole street"),
    ("wickerdusk", "the hour when lamps are lit in a village"),
    ("marrowlight", "the dim light inside a snow cave"),
    ("bramblewick", "a candle wick woven from dried bramble stems"),
    ("ostraphone", "a horn carved from a large sea shell"),
    ("cobblewise", "skilled at repairing old stone roads"),
    ("lindentwine", "a rope spun from the bark of lime trees"),
    ("thistlebrook", "a stream bordered by wild thistles"),
    ("vesperling", "a bird that sings only in the evening"),
    ("grumbleweed", "a weed that rattles when the wind blows"),
    ("copperdew", "morning dew tinted by mineral-rich soil"),
    ("fathomline", "a knotted rope for measuring the depth of wells"),
    ("nettlecap", "a knitted hat dyed with nettle juice"),
    ("starrow", "a row of lanterns along a harbour wall"),
    ("puddingstone", "a rock made of rounded pebbles set in sand"),
    ("emberglass", "glass that keeps warmth long after the fire dies"),
    ("riverkeep", "a person who clears fallen branches from a river"),
    ("mossmantle", "a thick layer of moss covering a rooftop"),
    ("hearthbound", "unwilling to travel far from home"),
    ("clinkerboat", "a boat built from overlapping planks"),
    ("willowsong", "the rustling sound of willow leaves in wind"),
    ("duskwarden", "a guard who closes the town gates at night"),
    ("frostpetal", "a flower that blooms under light snow"),
)
GLOSS_INTROS = ("Glossary from a regional travel guide:", "Here are some terms from my grandmother's notebook.",
                "Word list (local dialect):", "From the appendix of the field guide:")
GLOSS_QUESTIONS = ("Using the list above, what is {w}?", "According to the glossary, what does {w} refer to?",
                   "In these notes, what's meant by \"{w}\"?", "so what would a {w} be?",
                   "From that appendix: {w} - what is it?")

DOC_FUNCTIONS = ("calendar.isleap", "calendar.leapdays", "calendar.monthrange", "calendar.weekday", "copy.deepcopy",
                 "copy.copy", "dataclasses.asdict", "dataclasses.astuple", "dataclasses.fields", "dataclasses.replace",
                 "dataclasses.is_dataclass", "email.utils.parseaddr", "filecmp.cmp", "filecmp.cmpfiles", "glob.escape",
                 "glob.glob", "gzip.compress", "gzip.decompress", "gzip.open", "heapq.nlargest", "heapq.nsmallest",
                 "heapq.merge", "json.dumps", "mimetypes.guess_type", "mimetypes.guess_extension",
                 "mimetypes.add_type", "platform.python_version", "platform.node", "shlex.quote", "shlex.split",
                 "shlex.join", "statistics.median", "statistics.mode", "statistics.fmean", "statistics.pstdev",
                 "statistics.harmonic_mean", "statistics.median_low", "statistics.multimode", "tarfile.is_tarfile",
                 "webbrowser.open", "webbrowser.open_new_tab", "pathlib.Path.with_suffix",
                 "fractions.Fraction.limit_denominator")
"""Library functions the passage task asks about. Each is defined in a standard-library module whose name's CRC-32 is
divisible by 5 (`reserved_module`): the training generator's passages leave those modules out."""


def reserved_module(module: str) -> bool:
    """The split both generators agree on: these stdlib modules' docstrings are the evaluation's."""
    return zlib.crc32(module.encode()) % 5 == 0


DOC_INTROS = ("Reference entries (Python standard library):", "Excerpt from the docs:",
              "I copied these from the documentation:", "API notes:")
DOC_QUESTIONS = ("Based on these entries, what does {f} do?", "What is {f} for, according to the docs above?",
                 "Per the excerpt, {f} - what does it do?", "Reading the notes, explain {f} in one line.")


def summary(doc: str) -> str:
    """A docstring's first sentence, on one line."""
    first = " ".join(doc.split("\n\n")[0].split())
    end = first.find(". ")
    return (first if end == -1 else first[:end + 1]).rstrip(".")


def gold_span(sentence: str) -> str:
    """What an answer must contain: the summary without its leading verb ("Return the median ..." -> "the median
    ..."), so "It returns the median ..." counts."""
    head, _, rest = sentence.partition(" ")
    return rest if head.lower().rstrip("s") in ("return", "compute", "remove", "add", "convert", "split", "make",
                                                "test", "construct", "escape", "generate", "deserialize",
                                                "find", "get", "use") and rest else sentence


def doc_entries() -> list[tuple[str, str, str]]:
    """(qualified name, signature line + docstring paragraph, summary) for DOC_FUNCTIONS that have a usable one."""
    import importlib

    out = []
    for q in DOC_FUNCTIONS:
        parts = q.split(".")
        for i in range(len(parts) - 1, 0, -1):
            try:
                obj, rest = importlib.import_module(".".join(parts[:i])), parts[i:]
                break
            except ImportError:
                continue
        for attr in rest:
            obj = getattr(obj, attr)
        if not reserved_module(obj.__module__):
            raise ValueError(f"{q} is defined in {obj.__module__}, which the training passages may use")
        doc = inspect.getdoc(obj) or ""
        s = summary(doc)
        if not 15 <= len(s) <= 120:
            continue
        try:
            sig = f"{q}{inspect.signature(obj)}"
        except (TypeError, ValueError):
            sig = f"{q}(...)"
        para = " ".join(doc.split("\n\n")[0].split())
        out.append((q, f"{sig}\n    {para}", s))
    return out


def passage_rows(rng: random.Random, n_gloss: int, n_doc: int) -> list[dict]:
    rows = []
    for _ in range(n_gloss):
        entries = rng.sample(GLOSSARY, rng.choice((4, 5, 6)))
        w, gloss = rng.choice(entries)
        body = "\n".join(f"{a} - {b}." if rng.random() < 0.5 else f"{a}: {b}." for a, b in entries)
        q = rng.choice(GLOSS_QUESTIONS).format(w=w)
        intro = rng.choice(GLOSS_INTROS)
        rows.append({"task": "passage", "source": "glossary", "thinking_mode": rng.choice((None, "disabled")),
                     "messages": [{"role": "user", "content": f"{intro}\n{body}\n\n{q}"}], "tools": None,
                     "request": f"{intro}\n\n{q}", "expected": {"gold": gloss}})
    docs = doc_entries()
    for _ in range(n_doc):
        entries = rng.sample(docs, rng.choice((3, 4)))
        q_name, _, s = rng.choice(entries)
        body = "\n\n".join(e[1] for e in entries)
        q = rng.choice(DOC_QUESTIONS).format(f=q_name)
        intro = rng.choice(DOC_INTROS)
        rows.append({"task": "passage", "source": "stdlib_docs", "thinking_mode": rng.choice((None, "disabled")),
                     "messages": [{"role": "user", "content": f"{intro}\n\n{body}\n\n{q}"}], "tools": None,
                     "request": f"{intro}\n\n{q}", "expected": {"gold": gold_span(s)}})
    return rows


ARITH = ("Add {a} and {b}.", "What do you get when you take {b} away from {a}?", "{a} plus {b} equals what?",
         "Quick maths: {a} - {b}", "If I had {a} marbles and got {b} more, how many would I have?",
         "what's {a} take away {b}", "Sum of {a} and {b}, please.", "Work out {a} minus {b} for me.",
         "I need {a} + {b}.", "Difference between {a} and {b}?")


def arith_rows(rng: random.Random, n_per_mode: int) -> list[dict]:
    rows = []
    for mode in ("enabled", "disabled"):
        for _ in range(n_per_mode):
            t = rng.choice(ARITH)
            a, b = rng.randint(10, 999), rng.randint(10, 999)
            minus = any(w in t for w in ("away", " - ", "minus", "Difference"))
            if "Difference" in t and a < b:
                a, b = b, a
            q = t.format(a=a, b=b)
            rows.append({"task": "arith", "thinking_mode": mode, "messages": [{"role": "user", "content": q}],
                         "tools": None, "request": q, "expected": {"answer": str(a - b if minus else a + b)}})
    return rows


OUT_OF_SCOPE = (
    "Who won the football match last night?", "What's the exchange rate of the yen this very minute?",
    "What did I eat for breakfast today?", "What is my neighbour's phone number?",
    "How many people live in Plovdiv right now?", "What will the stock market do next week?",
    "What's the name of my first pet?", "Who is the current mayor of Tartu?",
    "Which song is number one on the charts this week?", "What time does my dentist close today?",
    "How much does my car weigh?", "What's the population of Ljubljana in 2027?",
    "Who will win the next election in Brno?", "What was the closing price of gold yesterday?",
    "Where did I leave my keys?", "How many emails are in my inbox?", "What's the Wi-Fi password at my office?",
    "Which team will win the cup next year?", "What is the average rainfall in Odense in March?",
    "Who wrote the novel The Salt Road?", "What's the traffic like on the ring road right now?",
    "What grade did my son get on his test?", "How old is my landlord?", "What's today's lunch special downstairs?",
    "What is the tallest building in Cluj?", "When is my next doctor's appointment?",
    "How many calories are in the cake my aunt baked?", "Is the bakery on my street open right now?",
    "What's the score in the tennis final?", "What year was the Linden Street bridge in Graz built?",
    "Which flight is my sister on tonight?", "How much money is in my savings account?",
    "What's the latest news about the Trieste harbour strike?", "What's my blood type?",
    "Who is going to win tonight's chess championship?", "What was the weather in Bilbao on 3 May 1987?",
    "What's the serial number of my laptop?", "How many visitors did the Aarhus museum have last month?",
    "Which of my friends is free on Saturday?", "What did the CEO say at this morning's meeting?",
)


def out_of_scope_rows(rng: random.Random) -> list[dict]:
    return [{"task": "out_of_scope", "thinking_mode": rng.choice((None, "disabled")),
             "messages": [{"role": "user", "content": q}], "tools": None, "request": q, "expected": {}}
            for q in OUT_OF_SCOPE]


# -- retrieval: lockers in pages of notes --------------------------------------------------------------------------
LOCKER_WORDS = ("Heron", "Juniper", "Quartz", "Falcon", "Maple", "Cobalt", "Thistle", "Saffron", "Granite", "Willow",
                "Otter", "Cedar", "Amber", "Lichen", "Pewter", "Sorrel", "Tundra", "Indigo", "Marlin", "Basalt")
FILLER = (
    "The ferry to {town} leaves at {time} on weekdays and an hour later on Sundays.",
    "{person} planted {n} rows of {plant} along the {place} this spring.",
    "Our bakery order for {town} was {n} loaves of rye and a box of {food}.",
    "The {place} in {town} is closed for repairs until the end of the month.",
    "{person} said the {food} at the market in {town} was better than last year.",
    "Remember to water the {plant} twice a week while {person} is away.",
    "The meeting about the new {place} was moved to {time} on Thursday.",
    "{person} and {person2} cycled {n} kilometres to {town} and back.",
    "A parcel from {town} arrived with {n} jars of {food} inside.",
    "The choir practises in the {place} every second evening at {time}.",
    "{person} borrowed the long ladder to fix the {place} roof.",
    "Tickets for the {town} fair cost {n} euros at the gate.",
)
FILL = {"place": ("boathouse", "old mill", "town hall", "greenhouse", "library annex", "harbour wall", "bell tower"),
        "plant": ("leeks", "sunflowers", "runner beans", "lavender", "strawberries", "rhubarb"),
        "food": ("plum jam", "smoked cheese", "pickled herring", "honey cake", "apple cider", "rye crackers")}
NEEDLE = ("Locker {loc} opens with the combination {code}.", "The combination for locker {loc} is {code}.",
          "Note to self: locker {loc} uses combination {code}.")
LOCKER_QUESTIONS = ("What is the combination for locker {loc}?", "Which combination opens locker {loc}?",
                    "I forgot how to open locker {loc}. What's its combination?",
                    "Look through the notes: what combination does locker {loc} use?")
RETRIEVAL_INTROS = ("These are the caretaker's notes.", "Below are my notes from the last few months.",
                    "Here is the logbook of the community centre.")


def _filler_sentence(rng: random.Random) -> str:
    return rng.choice(FILLER).format(town=rng.choice(TOWNS), time=_clock(rng)[0], person=rng.choice(PEOPLE),
                                     person2=rng.choice(PEOPLE), n=rng.randint(2, 40), **{
                                         k: rng.choice(v) for k, v in FILL.items()})


def retrieval_rows(rng: random.Random, tokens: int, n_docs: int, per_doc: int, count_tokens) -> tuple[list, list]:
    """Documents of about `tokens` tokens (the whole prompt, question included, stays below it) with ~40 lockers,
    and `per_doc` questions each about a locker at a different depth."""
    rows, documents = [], []
    for d in range(n_docs):
        lockers = []
        while len(lockers) < 40:
            loc = f"{rng.choice(LOCKER_WORDS)}-{rng.randint(10, 99)}"
            if loc not in [x[0] for x in lockers]:
                lockers.append((loc, f"{rng.randint(0, 999999):06d}"))
        sentences = [_filler_sentence(rng) for _ in range(tokens // 14)]
        slots = sorted(rng.sample(range(len(sentences)), len(lockers)))
        for (loc, code), slot in zip(reversed(lockers), reversed(slots)):
            sentences.insert(slot, rng.choice(NEEDLE).format(loc=loc, code=code))
        # the whole prompt (chat template ~60 tokens, intro and question ~30) stays below `tokens`
        while count_tokens(" ".join(sentences)) > tokens - 140:
            drop = [i for i, s in enumerate(sentences) if "ocker" not in s]
            for i in sorted(rng.sample(drop, max(1, len(drop) // 50)), reverse=True):
                del sentences[i]
        text = " ".join(sentences)
        doc_id = f"notes-{tokens // 1024}k-{d}"
        documents.append({"id": doc_id, "text": text})
        intro = rng.choice(RETRIEVAL_INTROS)
        mode = None if d % 2 == 0 else "disabled"
        # questions about lockers spread from the start of the document to its end
        order = sorted(range(len(lockers)), key=lambda i: text.index(lockers[i][0] + " ") if lockers[i][0] + " "
                       in text else 0)
        picks = [order[int((k + 0.5) * len(order) / per_doc)] for k in range(per_doc)]
        for i in picks:
            loc, code = lockers[i]
            q = rng.choice(LOCKER_QUESTIONS).format(loc=loc)
            rows.append({"task": f"retrieval_{tokens // 1024}k", "document": doc_id, "thinking_mode": mode,
                         "messages": [{"role": "user", "content": f"{intro}\n\n{DOCUMENT}\n\n{q}"}], "tools": None,
                         "request": f"{intro}\n\n{q}", "expected": {"value": code, "locker": loc}})
    return rows, documents


def write_jsonl(path: str, rows: list[dict]) -> None:
    """gzip without a timestamp: the same rows give the same bytes."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz:
        for r in rows:
            gz.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))


def build(out: str) -> dict[str, int]:
    from tokenizers import Tokenizer

    from nanoserve.presets.catalog import SHIPPED

    tok = Tokenizer.from_file(os.path.join(SHIPPED["m3-mini"], "tokenizer.json"))

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    rng = random.Random(SEED)
    rows = tool_rows(rng, per_tool=5)
    rows += no_call_rows(rng, 48)
    rows += result_rows(rng, per_app=4)
    rows += passage_rows(rng, 30, 30)
    rows += arith_rows(rng, 40)
    rows += out_of_scope_rows(rng)
    documents = []
    for tokens, n_docs, per_doc in ((8192, 2, 8), (16384, 2, 8)):
        r, d = retrieval_rows(rng, tokens, n_docs, per_doc, count_tokens)
        rows += r
        documents += d
    # each task's requests in a shuffled order (a retrieval task's stay by document), so that the first N of a
    # task (--quality-limit N) mix its apps, thinking modes and sources
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r)
    rows = []
    for task, rs in by_task.items():
        if not task.startswith("retrieval"):
            rng.shuffle(rs)
        rows += rs
    for i, r in enumerate(rows):
        r["id"] = i
    os.makedirs(out, exist_ok=True)
    write_jsonl(os.path.join(out, "requests.jsonl.gz"), rows)
    write_jsonl(os.path.join(out, "documents.jsonl.gz"), documents)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["task"]] = counts.get(r["task"], 0) + 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=HERE)
    args = ap.parse_args()
    for task, n in build(args.out).items():
        print(f"{task:16s} {n}")


if __name__ == "__main__":
    main()
