"""Saying "I don't know": questions a small offline model cannot answer, and the short honest replies to them.

    unknown_exchange(rng, mode)   one such question and its reply
    sample_unknown(rng, src)      an `unknown` chat

What it cannot know: live data (scores, prices, traffic, the weather with no tool to ask), the user's own life
(their schedule, their passwords, what they did), facts too specific for ten million parameters (the population of
a town, who runs a company, a building's age), and the future. Each reply says so in a sentence and, where it
helps, what would: a tool, a search, the user's own records. The same questions with a tool that answers them
offered are `request` chats (training/requests.py): the tool is called instead.
"""

from __future__ import annotations

import random

from training.chats import (
    CITIES,
    COUNTRIES,
    FIRST_NAMES,
    Chat,
    Exchange,
    Sources,
    _assistant,
    _chat,
    _pick_mode,
    _think,
)
from training.requests import COINS, STOCKS, TEAMS

SPORTS = ("football", "basketball", "hockey", "cricket", "rugby", "baseball")
PRIVATE = ("my sister's birthday", "my home address", "my bank balance", "my favourite colour", "my password",
           "my boss's name", "my schedule for tomorrow", "my car's licence plate", "my doctor's phone number",
           "my cat's age", "my PIN", "my flight number")
PAST = ("did I eat yesterday", "did I say in my last email", "did my wife buy at the store", "did I lose my wallet",
        "time did I go to bed")
OBSCURE = ("How many inhabitants does {city} have?", "Who is the mayor of {city}?", "How tall is the tallest tower in "
           "{city}?", "When was the oldest bridge in {city} built?", "How many schools are there in {country}?",
           "Who owns the biggest company in {country}?", "What is the average salary in {city}?",
           "How many trees grow in {country}?", "Who designed the main station of {city}?")
LIVE = ("Who won the {sport} game last night?", "What's the score of the {team} match right now?",
        "Is the {team} game on today?", "How much is {stock} trading at this minute?",
        "What's the price of {coin} right now?", "Is traffic bad in {city} at the moment?",
        "What's the weather in {city} right now?", "Are flights to {city} delayed today?",
        "What are today's headlines?", "Which shops in {city} are open now?")
FUTURE = ("Will it rain in {city} next month?", "Who will win the {sport} league this year?",
          "Will {stock} go up tomorrow?", "What will {coin} be worth next year?", "Will my exam go well?",
          "Will {name} call me back today?")

REPLIES = {
    "live": ("I don't know. I have no access to live data, so I can't tell you that.",
             "I can't check that: I have no connection to current information.",
             "I'm not able to see live information, so I don't know. A news site or an app would tell you.",
             "I don't know the current {what}; I have no access to live data."),
    "private": ("I don't know {what}. I have no access to your personal information.",
                "I can't know that: I don't have access to your data.",
                "I don't have that information. Only you or your own records would know it."),
    "past": ("I don't know. I can't see what you did.", "I have no way to know that; I don't see your life or data.",
             "I'm not sure, and I can't check: I don't have access to that."),
    "obscure": ("I'm not sure. I'm a small model and I don't know facts like that reliably.",
                "I don't know that. It's best to look it up in a reliable source.",
                "I don't know the answer to that, and I'd rather not guess."),
    "future": ("I can't know the future, so I can't tell you.", "Nobody can know that for sure, so I can't tell you.",
               "I don't know; that hasn't happened yet."),
}
WHY = "I cannot know this, so I say so instead of guessing."


def unknown_exchange(rng: random.Random, mode: str) -> Exchange:
    kind = rng.choice(("live", "live", "private", "past", "obscure", "obscure", "future"))
    fill = dict(city=rng.choice(CITIES), country=rng.choice(COUNTRIES), sport=rng.choice(SPORTS),
                team=rng.choice(TEAMS), stock=rng.choice(STOCKS), coin=rng.choice(COINS), name=rng.choice(FIRST_NAMES))
    what = ""
    if kind == "live":
        q = rng.choice(LIVE).format(**fill)
        what = "score" if "score" in q or "won" in q else "price" if "price" in q or "trading" in q else "situation"
    elif kind == "private":
        thing = rng.choice(PRIVATE)
        q = rng.choice((f"What is {thing}?", f"Can you tell me {thing}?", f"Remind me of {thing}.",
                        f"Do you know {thing}?"))
        what = thing.replace("my ", "your ")
    elif kind == "past":
        q = f"What {rng.choice(PAST)}?"
    elif kind == "obscure":
        q = rng.choice(OBSCURE).format(**fill)
    else:
        q = rng.choice(FUTURE).format(**fill)
    reply = rng.choice(REPLIES[kind]).format(what=what)
    return Exchange(q, [_assistant(reply, WHY if _think(mode, 0.05, rng) else "")], {"reply": reply})


def sample_unknown(rng: random.Random, src: Sources) -> Chat:
    mode = _pick_mode(rng, enabled=0.15, disabled=0.3)
    return _chat(rng, "unknown", mode, [unknown_exchange(rng, mode)], None)
