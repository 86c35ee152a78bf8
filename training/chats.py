"""Synthetic chats in MiniMax M3's format, the supervised part of m3-mini's training data.

    Chat                       one conversation: OpenAI-shaped messages, tools, thinking_mode, its kind and what a
                               grader checks (`expected`)
    sample(rng, kind, **kw)    one chat of a kind (KINDS), deterministic given rng
    mixture(rng, **kw)         a draw from the training mixture (weights: MIXTURE)
    render(chat, template)     the whole conversation as (text, trains) segments; trains marks the assistant
                               turns after the last user message, the ones the loss is taken on
    prompt(chat, template)     what the server renders for the first of those turns (add_generation_prompt=True)

Kinds: `arith` (2-3 digit addition/subtraction, the reasoning a digit-by-digit scratchpad), `tool` (procedurally
generated JSON-schema tools, the call, the tool's JSON result, an answer using it), `no_tool` (tools offered, none
needed), `chat` (greetings, identity, facts about nanoserve and serving), `define` (a word's gloss), `retrieval`
(pass keys hidden in long filler text), `multi_turn` (two or three exchanges of the above, the last one trained).
The three thinking modes appear across kinds; each assistant turn after the last user message obeys its chat's
mode: `enabled` ones all reason (the template opens the block for them), `disabled` ones never do, `adaptive`
ones decide (arithmetic thinks, a greeting does not).

Texts are built from word lists embedded below, so the module needs no file. Callers with richer text pass it in:
`glosses` ((word, gloss) pairs, e.g. WordNet's) for `define` and definitions inside chats, `sentences` (plain
sentences) for the retrieval filler.
"""

from __future__ import annotations

import importlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanoserve.chat_template import template_messages

TURN, EOT, AI = "]~b]", "[e~[", "]~b]ai\n"
THINK_START, THINK_END = "<mm:think>", "</mm:think>"
NS = "]<]minimax[>["
MARKERS = ("]~!b[", TURN, EOT, THINK_START, THINK_END, NS)
MODES = ("enabled", "disabled", "adaptive")
FORCED = {"enabled": THINK_START, "disabled": THINK_END, "adaptive": ""}  # what the generation prompt ends with


@dataclass
class Chat:
    """One synthetic conversation. `messages` are what a client sends (tool-call arguments as JSON strings);
    `thinking_mode` None is adaptive left unset; `expected` is what a grader compares the model's answer with
    (`answer` for arithmetic, `name` + `arguments` of the first call for tools, `value` for retrieval and
    definitions, `reply` for free conversation)."""

    messages: list[dict]
    tools: list[dict] | None
    thinking_mode: str | None
    kind: str
    expected: dict


# -- rendering --------------------------------------------------------------------------------------------------
_COMPILED: dict[str, Any] = {}


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def compiled(template: str):
    """The template compiled once, in the environment transformers' apply_chat_template renders with (the
    server's path): trimmed blocks, loop controls, a tojson that keeps non-ASCII text."""
    if template not in _COMPILED:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        _COMPILED[template] = env.from_string(template)
    return _COMPILED[template]


def render_text(chat: Chat, template: str, messages: list[dict] | None = None,
                add_generation_prompt: bool = False) -> str:
    """The template's rendering of `messages` (default: the whole chat) with the chat's tools and mode."""
    variables = {} if chat.thinking_mode is None else {"thinking_mode": chat.thinking_mode}
    return compiled(template).render(messages=template_messages(chat.messages if messages is None else messages),
                                     tools=chat.tools or None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **variables)


def _last_user(messages: list[dict]) -> int:
    return max(i for i, m in enumerate(messages) if m["role"] == "user")


def render(chat: Chat, template: str) -> list[tuple[str, bool]]:
    """The rendered chat as (text, trains) segments. A trained segment is one assistant turn after the last user
    message, from after its generation prompt (`]~b]ai\\n` and the think marker the mode forces) through its
    closing `[e~[`; everything else does not train. The segments concatenate to the template's render."""
    text = render_text(chat, template)
    forced = FORCED[chat.thinking_mode or "adaptive"]
    last = _last_user(chat.messages)
    pos = text.rindex(TURN + "user\n")
    pos = text.index(EOT + "\n", pos) + len(EOT) + 1
    segments, cursor = [], 0
    for m in chat.messages[last + 1:]:
        if m["role"] == "assistant":
            header = AI + forced
            if not text.startswith(header, pos):
                raise ValueError(f"{chat.kind}: an assistant turn after the last user message renders as "
                                 f"{text[pos:pos + 24]!r}, not {header!r} as thinking_mode "
                                 f"{chat.thinking_mode or 'adaptive'} makes the model start it")
            start = pos + len(header)
            end = text.index(EOT, start) + len(EOT)
            segments += [(text[cursor:start], False), (text[start:end], True)]
            cursor, pos = end, end + 1
        elif m["role"] == "tool" and text.startswith(TURN + "tool", pos):  # a run of results is one turn
            pos = text.index(EOT + "\n", pos) + len(EOT) + 1
    if pos != len(text):
        raise ValueError(f"{chat.kind}: the render does not end with the chat's last turn")
    segments.append((text[cursor:], False))
    return [s for s in segments if s[0]]


def prompt(chat: Chat, template: str) -> str:
    """What the server renders (add_generation_prompt=True) for the chat's first trained assistant turn."""
    return render_text(chat, template, chat.messages[:_last_user(chat.messages) + 1], add_generation_prompt=True)


# -- word lists ---------------------------------------------------------------------------------------------------
def _words(s: str) -> tuple[str, ...]:
    return tuple(s.split())


VERBS = _words("""get find check book send create update delete list search fetch compute convert schedule cancel
    track order reserve translate summarize lookup add remove set reset start stop open close rate review share
    upload download validate verify estimate calculate count play pause record register subscribe notify
    assign approve reject archive export import print scan sync merge split sort filter rank measure predict
    analyze locate ship rent buy sell transfer refund renew publish draft edit""")
NOUNS = _words("""weather flight hotel restaurant recipe movie song book invoice order ticket account user file
    report meeting event reminder alarm timer note task project issue package shipment route train bus taxi
    car bike room table seat menu price stock currency rate loan payment budget expense receipt contract
    message email contact calendar photo video playlist podcast article news score match team player game
    course lesson exam grade student library museum park beach hike trail forecast temperature garden plant
    pet doctor appointment prescription pharmacy store product review coupon cart wallet device battery
    printer network password backup server database query record invoice lecture concert festival""")
ADJECTIVES = _words("""red blue green quiet loud small large fast slow bright dark warm cold fresh old new
    early late simple modern ancient gentle busy calm happy rapid narrow wide heavy light sweet bitter
    golden silver wooden rural urban hidden open round sharp soft""")
CITIES = _words("""Paris London Berlin Madrid Rome Lisbon Vienna Prague Warsaw Oslo Stockholm Helsinki Dublin
    Amsterdam Brussels Zurich Geneva Athens Istanbul Cairo Nairobi Lagos Johannesburg Tokyo Osaka Seoul Beijing
    Shanghai Singapore Bangkok Hanoi Jakarta Manila Sydney Melbourne Auckland Toronto Vancouver Montreal Chicago
    Boston Denver Seattle Austin Miami Atlanta Lima Bogota Santiago Quito Havana Mumbai Delhi Dubai Doha Tehran
    Moscow Kyiv Riga Tallinn Vilnius Budapest Bucharest Sofia Belgrade Zagreb Porto Seville Valencia Milan Naples
    Lyon Marseille Nice Hamburg Munich Cologne Krakow Bergen Reykjavik Marrakesh Tunis Accra Dakar Lusaka""")
FIRST_NAMES = _words("""Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Leo Maria Nina Oscar Paula
    Quentin Rosa Sam Tina Umar Vera Walter Xenia Yusuf Zoe Aiko Bruno Chen Dmitri Elena Fatima Gustav Hana Ivan
    Jonas Kofi Lucia Mateo Noor Olga Pedro Ravi Sofia Tomas Ugo Valeria Wei Yara Amir Bianca Diego Ines Kenji
    Lena Marco Priya Selin Theo""")
LAST_NAMES = _words("""Smith Garcia Muller Rossi Dubois Silva Novak Kowalski Jensen Tanaka Kim Nguyen Patel Okafor
    Berg Costa Ivanova Larsen Moreau Schmidt Weber Romero Lindqvist Haddad Mensah Sato Park Fischer Bauer Cruz
    Hansen Petrov Ortiz Meyer Rahman Yilmaz Santos Fernandes Khan Lopez""")
COUNTRIES = _words("""France Germany Spain Italy Portugal Norway Sweden Finland Poland Greece Egypt Kenya
    Nigeria Japan Korea China Thailand Vietnam India Brazil Argentina Chile Peru Mexico Canada Australia Ireland
    Austria Hungary Romania Turkey Morocco Ghana Senegal Iceland Denmark""")
LANGUAGES = _words("""English French German Spanish Italian Portuguese Dutch Swedish Polish Greek Turkish Arabic
    Hindi Japanese Korean Chinese Russian Finnish Czech Vietnamese""")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy", "partly cloudy", "humid")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
CAPITALS = {"France": "Paris", "Germany": "Berlin", "Spain": "Madrid", "Italy": "Rome", "Portugal": "Lisbon",
            "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens",
            "Egypt": "Cairo", "Kenya": "Nairobi", "Japan": "Tokyo", "Thailand": "Bangkok", "Vietnam": "Hanoi",
            "Peru": "Lima", "Chile": "Santiago", "Canada": "Ottawa", "Australia": "Canberra", "Ireland": "Dublin",
            "Austria": "Vienna", "Hungary": "Budapest", "Denmark": "Copenhagen", "Iceland": "Reykjavik",
            "Senegal": "Dakar", "Ghana": "Accra", "Morocco": "Rabat", "Mexico": "Mexico City"}

# definitions for `define` when the caller passes no glosses
GLOSSES = (
    ("token", "a piece of text, such as a word or part of a word, that a language model reads and writes"),
    ("cache", "a store of data kept close at hand so that it can be used again quickly"),
    ("batch", "a group of things handled together at the same time"),
    ("kernel", "a small program that runs on a GPU and computes one step of a model"),
    ("river", "a large natural stream of water flowing in a channel to the sea or a lake"),
    ("library", "a collection of books, or a room or building where they are kept"),
    ("bridge", "a structure that carries a road or path across a river or a valley"),
    ("compass", "an instrument that shows the direction of magnetic north"),
    ("harvest", "the gathering of a ripe crop"),
    ("orchard", "a piece of land planted with fruit trees"),
    ("glacier", "a slowly moving mass of ice formed from snow on mountains"),
    ("volcano", "a mountain with an opening through which lava and gas come out"),
    ("island", "a piece of land surrounded by water"),
    ("telescope", "an instrument that makes distant objects appear nearer"),
    ("recipe", "a set of instructions for preparing a dish"),
    ("lantern", "a lamp with a transparent case that protects its flame"),
    ("meadow", "a field of grass, often with wild flowers"),
    ("anchor", "a heavy object dropped from a boat to keep it in place"),
    ("puzzle", "a game or problem that tests a person's skill or knowledge"),
    ("thermometer", "an instrument for measuring temperature"),
    ("alphabet", "the set of letters used to write a language"),
    ("calendar", "a chart showing the days, weeks and months of a year"),
    ("planet", "a large body in space that moves around a star"),
    ("umbrella", "a folding frame covered with cloth, held over the head against rain"),
    ("harbor", "a sheltered place on a coast where ships can stay safely"),
    ("forest", "a large area covered mostly with trees"),
    ("desert", "a dry region with very little rain and few plants"),
    ("algorithm", "a precise list of steps for solving a problem"),
    ("scheduler", "the part of a system that decides which work runs next"),
    ("latency", "the time between a request and its response"),
    ("throughput", "the amount of work done in a given time"),
    ("expert", "a person with great skill or knowledge in a field"),
    ("router", "a device or component that decides where each item is sent"),
    ("violin", "a bowed string instrument held under the chin"),
    ("bakery", "a shop where bread and cakes are made or sold"),
    ("journey", "an act of travelling from one place to another"),
    ("mirror", "a surface that reflects a clear image"),
    ("ladder", "a set of steps between two long sides, used for climbing"),
    ("candle", "a stick of wax with a wick that gives light when burning"),
    ("whisper", "speech spoken very softly"),
)

IDENTITY = (
    "I am m3-mini, a small model with MiniMax M3's architecture, served by nanoserve.",
    "I'm m3-mini: a tiny language model built like MiniMax M3 and served by nanoserve.",
    "My name is m3-mini. I am a small model with the architecture of MiniMax M3, running on nanoserve.",
    "I am m3-mini, a small MiniMax M3-style model. nanoserve is the engine serving me.",
)
# (questions, answers) about the engine and serving
FACTS = (
    (("What is nanoserve?", "Tell me about nanoserve.", "What does nanoserve do?"),
     ("nanoserve is a compact inference engine for MiniMax M3, written in Python on PyTorch and Triton.",
      "nanoserve is a small inference engine that serves MiniMax M3 models with an OpenAI-compatible API.")),
    (("What is continuous batching?", "Explain continuous batching."),
     ("Continuous batching lets new requests join the running batch at every step, and finished ones leave at once.",
      "With continuous batching the batch changes from step to step, so the accelerator stays busy.")),
    (("What is a KV cache?", "What is the KV cache for?"),
     ("The KV cache keeps the keys and values of earlier tokens, so each step only computes the new token.",)),
    (("What is paged attention?", "Why are KV blocks paged?"),
     ("The KV cache is split into fixed-size blocks, like pages of memory, so a sequence takes memory only as it "
      "grows.",)),
    (("What is prefix caching?",),
     ("Prefix caching lets requests that start with the same text share the KV blocks of that prefix.",)),
    (("What is chunked prefill?",),
     ("Chunked prefill splits a long prompt into chunks, so it never stalls the decoding of other requests.",)),
    (("What is a mixture of experts?", "What is MoE?"),
     ("A mixture of experts routes each token to a few expert networks out of many, plus a shared expert.",)),
    (("What is MSA?", "What is sparse attention?"),
     ("In MiniMax Sparse Attention an indexer scores blocks of earlier tokens and each query attends to the best "
      "ones.",)),
    (("What is tensor parallelism?",),
     ("Tensor parallelism splits every layer across several devices and joins the partial results with an all "
      "reduce.",)),
    (("What is greedy decoding?", "What does temperature zero do?"),
     ("Greedy decoding always picks the most likely next token, so the output is deterministic.",)),
    (("What is a tokenizer?",),
     ("A tokenizer turns text into token ids and back again.",)),
    (("Which API does nanoserve serve?", "Is nanoserve compatible with OpenAI clients?"),
     ("nanoserve serves an OpenAI-compatible API: chat completions, completions and more.",)),
)
GREETINGS = ("Hello!", "Hi!", "Hey there.", "Good morning!", "Hello, how are you?", "Hi, nice to meet you.",
             "Good evening.", "Hey!")
GREETING_REPLIES = ("Hello! How can I help you today?", "Hi! What can I do for you?",
                    "Hello! I'm m3-mini. How can I help?", "Hi there! Ask me anything.",
                    "Good to see you. How can I help?")
SMALL_TALK = (
    (("Who are you?", "What is your name?", "What are you?", "Introduce yourself.", "Hello! Who are you?"), IDENTITY),
    (("What can you do?", "How can you help me?"),
     ("I can chat, do simple arithmetic, define words, find facts in a long text and call tools you give me.",
      "I can answer short questions, add and subtract numbers, call tools and find pass keys in long texts.")),
    (("Thank you!", "Thanks a lot.", "Thanks!"),
     ("You're welcome!", "Glad I could help.", "Any time!")),
    (("Goodbye!", "Bye!", "See you later."), ("Goodbye!", "Bye! Have a nice day.", "See you!")),
    (("How are you?", "How are you doing today?"),
     ("I'm fine, thank you. How can I help?", "Doing well, thanks! What can I do for you?")),
    (("Are you a large model?", "How big are you?"),
     ("No, I am small: about ten million parameters, with the architecture of MiniMax M3.",)),
)


def _filler_pool() -> tuple[str, ...]:
    """Plain sentences for the retrieval filler when the caller passes none (fixed: built from seed 0)."""
    r = random.Random(0)
    shapes = ("The {a} {n} is near the {n2}.", "A {a} {n} stood beside the {n2} in {c}.",
              "Every {m}, the {n} of {c} becomes {a}.", "{f} found a {a} {n} behind the {n2}.",
              "People in {c} talk about the {n} and the {n2}.", "The {n2} was {a}, and the {n} was {a2}.",
              "Nobody expected the {n} to be so {a}.", "In {m}, {f} went to {c} to see the {n}.")
    return tuple(r.choice(shapes).format(a=r.choice(ADJECTIVES), a2=r.choice(ADJECTIVES), n=r.choice(NOUNS),
                                         n2=r.choice(NOUNS), c=r.choice(CITIES), m=r.choice(MONTHS),
                                         f=r.choice(FIRST_NAMES)) for _ in range(4000))


FILLER = _filler_pool()


# -- building blocks --------------------------------------------------------------------------------------------
@dataclass
class Exchange:
    """One user message and the messages that answer it (assistant turns, tool results)."""

    user: str
    replies: list[dict]
    expected: dict


@dataclass
class Sources:
    """Text the caller brings: (word, gloss) pairs, filler sentences and library reference entries ((name,
    signature, paragraph, summary), training/passages.py)."""

    glosses: Sequence[tuple[str, str]] = GLOSSES
    sentences: Sequence[str] = FILLER
    docs: Sequence[tuple[str, str, str, str]] = ()


def _assistant(content: str, reasoning: str = "", tool_calls: list[dict] | None = None) -> dict:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        m["reasoning_content"] = reasoning
    if tool_calls:
        m["tool_calls"] = tool_calls
    return m


def _pick_mode(rng: random.Random, enabled: float, disabled: float) -> str:
    x = rng.random()
    return "enabled" if x < enabled else "disabled" if x < enabled + disabled else "adaptive"


def _think(mode: str, adaptive_p: float, rng: random.Random) -> bool:
    """Whether an assistant turn reasons: always when enabled, never when disabled, else with adaptive_p."""
    return mode == "enabled" or (mode == "adaptive" and rng.random() < adaptive_p)


def _chat_mode(mode: str, rng: random.Random) -> str | None:
    """The Chat's thinking_mode: adaptive is mostly left unset (the server's default), sometimes named."""
    return mode if mode != "adaptive" or rng.random() < 0.1 else None


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


# -- arith --------------------------------------------------------------------------------------------------------
def _digits(n: int) -> list[int]:
    return [int(c) for c in reversed(str(n))]


def scratchpad(a: int, op: str, b: int) -> str:
    """The worked digit-by-digit computation, right to left, with carries or borrows."""
    lines = []
    negate = op == "-" and a < b
    x, y = (b, a) if negate else (a, b)
    if negate:
        lines.append(f"{b} is larger than {a}, so compute {b} - {a} and negate.")
    lines.append(f"{x} {op} {y}: digits {' '.join(str(x))} and {' '.join(str(y))}, right to left.")
    dx, dy = _digits(x), _digits(y)
    carry = 0
    for i in range(max(len(dx), len(dy))):  # x is the longer one only when subtracting
        p, q = dx[i] if i < len(dx) else 0, dy[i] if i < len(dy) else 0
        if op == "+":
            s = p + q + carry
            lines.append(f"{p} + {q} + {carry} = {s}, write {s % 10}, carry {s // 10}.")
            carry = s // 10
        else:
            d = p - q - carry
            if d < 0:
                lines.append(f"{p} - {q} - {carry} = {d}, add 10: write {d + 10}, borrow 1.")
                carry = 1
            else:
                lines.append(f"{p} - {q} - {carry} = {d}, write {d}, borrow 0.")
                carry = 0
    if op == "+" and carry:
        lines.append(f"Write the last carry {carry}.")
    result = a + b if op == "+" else a - b
    lines.append(f"Result: {result}.")
    return "\n".join(lines)


def _arith_exchange(rng: random.Random, mode: str) -> Exchange:
    a = rng.randint(10, 999) if rng.random() < 0.7 else rng.randint(10, 99)
    b = rng.randint(10, 999) if rng.random() < 0.7 else rng.randint(10, 99)
    op = rng.choice("+-")
    result = a + b if op == "+" else a - b
    word = "plus" if op == "+" else "minus"
    questions = [f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"{a} {op} {b} = ?",
                 f"How much is {a} {word} {b}?", f"Calculate {a}{op}{b}.", f"What is {a} {word} {b}?",
                 f"Please work out {a} {op} {b}."]
    questions.append(f"What is the sum of {a} and {b}?" if op == "+" else f"Subtract {b} from {a}.")
    answers = [f"{a} {op} {b} = {result}.", f"The answer is {result}.", f"{a} {word} {b} is {result}.",
               f"{a} {op} {b} equals {result}."]
    # a turn that does not think writes the scratchpad in its answer: a model this small cannot produce a sum's
    # digits without working them out first
    thinks = _think(mode, 0.95, rng)
    answer = rng.choice(answers) if thinks else scratchpad(a, op, b) + "\n" + rng.choice(answers)
    return Exchange(rng.choice(questions), [_assistant(answer, scratchpad(a, op, b) if thinks else "")],
                    {"answer": str(result)})


# -- chat and define ---------------------------------------------------------------------------------------------
MAX_GLOSS = 160


def clean_gloss(gloss: str) -> str:
    """A gloss as one definition: WordNet's examples (after '; "') dropped, no trailing punctuation."""
    return gloss.split('; "')[0].split(";  ")[0].strip().rstrip(";.").strip()


def _define_exchange(rng: random.Random, mode: str, src: Sources) -> Exchange:
    for _ in range(8):  # a short definition: the answers stay short
        word, gloss = rng.choice(src.glosses)
        word, gloss = word.replace("_", " "), clean_gloss(gloss)
        if len(gloss) <= MAX_GLOSS:
            break
    q = rng.choice((f"What does {word} mean?", f"Define {word}.", f"What is the meaning of the word \"{word}\"?",
                    f"What does the word {word} mean?", f"Explain the word {word}.", f"Definition of {word}?"))
    a = rng.choice((f"{_cap(word)} means {gloss}.", f"\"{_cap(word)}\": {gloss}.", f"The word {word} means {gloss}.",
                    f"{_cap(word)}: {gloss}."))
    reasoning = (f"The user asks for the meaning of \"{word}\"; I give its definition."
                 if _think(mode, 0.05, rng) else "")
    return Exchange(q, [_assistant(a, reasoning)], {"value": gloss})


def _chat_exchange(rng: random.Random, mode: str, src: Sources) -> Exchange:
    x = rng.random()
    if x < 0.2:
        q, a, why = rng.choice(GREETINGS), rng.choice(GREETING_REPLIES), "A greeting: I greet back and offer help."
    elif x < 0.5:
        qs, answers = rng.choice(SMALL_TALK)
        q, a, why = rng.choice(qs), rng.choice(answers), "A short personal question: I answer it briefly."
    elif x < 0.8:
        qs, answers = rng.choice(FACTS)
        q, a, why = rng.choice(qs), rng.choice(answers), "A question about serving: I explain in one sentence."
    else:
        country = rng.choice(sorted(CAPITALS))
        q = rng.choice((f"What is the capital of {country}?", f"Which city is the capital of {country}?",
                        f"Capital of {country}?"))
        a = rng.choice((f"The capital of {country} is {CAPITALS[country]}.", f"It is {CAPITALS[country]}."))
        why = f"The capital of {country} is {CAPITALS[country]}."
    reasoning = why if _think(mode, 0.05, rng) else ""
    return Exchange(q, [_assistant(a, reasoning)], {"reply": a})


# -- tools --------------------------------------------------------------------------------------------------------
def _person(rng):
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}" if rng.random() < 0.7 else rng.choice(FIRST_NAMES)


def _date(rng):
    y, m, d = rng.randint(2020, 2030), rng.randint(1, 12), rng.randint(1, 28)
    return f"{y}-{m:02d}-{d:02d}" if rng.random() < 0.7 else f"{MONTHS[m - 1]} {d}"


def _number(rng):
    x = rng.randint(1, 9999) / rng.choice((10, 100))
    return x if x != int(x) else x + 0.5


# (category, parameter names, JSON type, value generator)
STRING_PARAMS: tuple[tuple[tuple[str, ...], Callable[[random.Random], Any]], ...] = (
    (("city", "location", "town", "destination", "origin", "place"), lambda r: r.choice(CITIES)),
    (("name", "person", "recipient", "contact", "user", "author", "guest", "owner"), _person),
    (("country", "region", "nation"), lambda r: r.choice(COUNTRIES)),
    (("date", "day", "start_date", "end_date", "deadline", "due"), _date),
    (("time", "start_time", "at"), lambda r: f"{r.randint(0, 23):02d}:{r.choice(('00', '15', '30', '45'))}"),
    (("email", "address"), lambda r: f"{r.choice(FIRST_NAMES).lower()}.{r.choice(LAST_NAMES).lower()}@example.com"),
    (("query", "text", "message", "title", "topic", "keyword", "note", "subject", "description"),
     lambda r: " ".join([r.choice(ADJECTIVES), r.choice(NOUNS)] + ([r.choice(NOUNS)] if r.random() < 0.3 else []))),
    (("language", "target_language", "lang"), lambda r: r.choice(LANGUAGES)),
    (("order_id", "ticket_id", "id", "code", "sku", "reference"),
     lambda r: f"{r.choice('ABCDEFGHKLMNPRSTXZ')}{r.choice(('-', ''))}{r.randint(100, 99999)}"),
)
INT_PARAMS = ("count", "limit", "days", "quantity", "nights", "guests", "page", "year", "age", "size", "seats",
              "top_k", "minutes", "hours", "level", "amount", "max_results", "rooms", "floor", "number")
NUMBER_PARAMS = ("amount", "price", "weight", "distance", "radius", "temperature", "rate", "budget", "height",
                 "threshold", "volume", "duration")
BOOL_PARAMS = ("verbose", "urgent", "notify", "include_details", "refundable", "public", "dry_run", "recursive",
               "express", "private", "include_archived", "confirm")
ENUMS = (
    (("unit", "units"), ("celsius", "fahrenheit")), (("system",), ("metric", "imperial")),
    (("priority", "level"), ("low", "normal", "high", "urgent")),
    (("format", "output"), ("json", "csv", "xml", "text", "pdf")),
    (("sort", "order"), ("asc", "desc")), (("channel", "via"), ("email", "sms", "push", "call")),
    (("status", "state"), ("open", "closed", "pending")), (("size",), ("small", "medium", "large")),
    (("mode", "style", "category", "kind", "type"), None),  # values: adjectives drawn per tool
)


@dataclass
class Param:
    name: str
    schema: dict
    value: Callable[[random.Random], Any]
    required: bool


@dataclass
class Tool:
    """A generated function tool: its OpenAI definition and how to draw arguments for it."""

    name: str
    verb: str
    noun: str
    params: list[Param]
    weather: bool = False  # the get_weather family: its own questions and results
    spec: dict = field(default_factory=dict)


def _param(rng: random.Random, taken: set[str]) -> Param:
    x = rng.random()
    desc = None
    if x < 0.45:
        names, gen = rng.choice(STRING_PARAMS)
        name, schema = rng.choice(names), {"type": "string"}
        desc = f"The {rng.choice(names).replace('_', ' ')}."
    elif x < 0.6:
        names, values = rng.choice(ENUMS)
        name = rng.choice(names)
        values = values or tuple(rng.sample(ADJECTIVES, rng.randint(2, 4)))
        schema = {"type": "string", "enum": list(values)}
        gen = lambda r, v=values: r.choice(v)  # noqa: E731
    elif x < 0.75:
        name, schema = rng.choice(INT_PARAMS), {"type": "integer"}
        gen = (lambda r: r.randint(1990, 2030)) if name == "year" else (
            lambda r: r.randint(1, 9) if r.random() < 0.5 else r.randint(10, 500))
    elif x < 0.85:
        name, schema, gen = rng.choice(NUMBER_PARAMS), {"type": "number"}, _number
    elif x < 0.95:
        name, schema, gen = rng.choice(BOOL_PARAMS), {"type": "boolean"}, lambda r: r.random() < 0.5
    else:  # a name never seen in any list: a noun, its value free words
        name, schema = rng.choice(NOUNS), {"type": "string"}
        gen = lambda r: f"{r.choice(ADJECTIVES)} {r.choice(NOUNS)}"  # noqa: E731
    if rng.random() < 0.15:
        name = f"{rng.choice(NOUNS)}_{name}"
    if name in taken:
        name = f"{name}_{len(taken) + 1}"
    if desc and rng.random() < 0.6:
        schema["description"] = desc
    return Param(name, schema, gen, required=False)


def make_tool(rng: random.Random, taken_names: set[str]) -> Tool:
    """A tool named verb_noun (sometimes verb_adjective_noun) with 1-4 parameters, the first one required; the
    question asking for it says "verb the [adjective] noun"."""
    verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
    if noun == "weather":  # weather questions belong to weather_tool's shapes
        noun = "forecast"
    if rng.random() < 0.15:  # the adjective is part of what the question names
        noun = f"{rng.choice(ADJECTIVES)}_{noun}"
    name = f"{verb}_{noun}"
    while name in taken_names or name in WEATHER_NAMES:
        name += "_" + rng.choice(NOUNS)
    params: list[Param] = []
    for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4))):
        params.append(_param(rng, {p.name for p in params}))
    for i, p in enumerate(params):
        p.required = i == 0 or rng.random() < 0.5
    return _finish_tool(rng, Tool(name, verb, noun, params))


WEATHER_NAMES = ("get_weather", "get_current_weather", "weather_forecast")


def weather_tool(rng: random.Random) -> Tool:
    """get_weather(city) - the tool users try first - in a few shapes."""
    name, key = rng.choice((("get_weather", "city"),) * 6 + (("get_weather", "location"),
                                                               ("get_current_weather", "location"),
                                                               ("get_current_weather", "city"),
                                                               ("weather_forecast", "city")))
    city = Param(key, {"type": "string"}, lambda r: r.choice(CITIES), required=True)
    if rng.random() < 0.5:
        city.schema["description"] = rng.choice(("The city name.", "City, e.g. Paris", "The city to look up."))
    params = [city]
    if rng.random() < 0.3:
        params.append(Param("unit", {"type": "string", "enum": ["celsius", "fahrenheit"]},
                            lambda r: r.choice(("celsius", "fahrenheit")), required=False))
    return _finish_tool(rng, Tool(name, "get", "weather", params, weather=True))


def _finish_tool(rng: random.Random, tool: Tool) -> Tool:
    props = {p.name: p.schema for p in tool.params}
    parameters: dict[str, Any] = {"type": "object", "properties": props}
    required = [p.name for p in tool.params if p.required]
    if required:
        parameters["required"] = required
    fn: dict[str, Any] = {"name": tool.name}
    if rng.random() < 0.85:
        fn["description"] = ("Get the current weather for a city." if tool.weather
                             else f"{_cap(tool.verb)} {_a(tool.noun.replace('_', ' '))}.")
    fn["parameters"] = parameters
    tool.spec = {"type": "function", "function": fn}
    return tool


def _arguments(rng: random.Random, tool: Tool) -> dict[str, Any]:
    return {p.name: p.value(rng) for p in tool.params if p.required or rng.random() < 0.5}


def _say(name: str, value: Any, rng: random.Random) -> str:
    """One argument as the user states it: the value written literally."""
    words = name.replace("_", " ")
    if isinstance(value, bool):
        v = rng.choice(("true", "yes")) if value else rng.choice(("false", "no"))
        return rng.choice((f"{words} {v}", f"{words}: {v}", f"{words} set to {v}"))
    return rng.choice((f"{words} {value}", f"{words} {value}", f"{words}: {value}", f"{words} = {value}",
                       f"{value} as the {words}"))


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _ask(rng: random.Random, tool: Tool, args: dict[str, Any]) -> str:
    """The request for one call: its arguments in the words of the question."""
    if tool.weather:
        city = args.get("city", args.get("location"))
        unit = f" in {args['unit']}" if "unit" in args else ""
        return rng.choice((f"What's the weather like in {city}{unit}?", f"How is the weather in {city} today{unit}?",
                           f"Weather in {city}{unit}?", f"Tell me the weather for {city}{unit}.",
                           f"Is it warm in {city} right now? Give me the temperature{unit}.",
                           f"What is the weather in {city}{unit}?", f"Can you check the weather in {city}{unit}?"))
    said = _join([_say(k, v, rng) for k, v in args.items()]) if args else ""
    what = f"the {tool.noun.replace('_', ' ')}"
    with_ = f" with {said}" if said else ""
    return rng.choice((f"Please {tool.verb} {what}{with_}.", f"Can you {tool.verb} {what}{with_}?",
                       f"I need to {tool.verb} {what}{': ' + said if said else ''}.",
                       f"{_cap(tool.verb)} {what}{', ' + said if said else ''}.",
                       f"Use a tool to {tool.verb} {what}{' (' + said + ')' if said else ''}."))


def _result(rng: random.Random, tool: Tool, args: dict[str, Any]) -> tuple[dict, str]:
    """A tool's JSON result and the sentence of the final answer that reports it."""
    if tool.weather:
        city = args.get("city", args.get("location"))
        unit = args.get("unit", "celsius")
        t = rng.randint(-10, 35) if unit == "celsius" else rng.randint(14, 95)
        cond = rng.choice(CONDITIONS)
        res = {"city": city, "temperature": t, "unit": unit, "condition": cond}
        return res, rng.choice((f"It is {cond} in {city}, {t} degrees {unit}.",
                                f"The weather in {city} is {cond} with {t} degrees {unit}.",
                                f"{city}: {cond}, {t} degrees {unit}."))
    fields = rng.sample(("result", "status", "total", "id", "count", "message", "price", "eta", "score", "summary"),
                        rng.randint(1, 2))
    res = {}
    for f in fields:
        res[f] = (rng.randint(1, 999) if f in ("total", "count", "score") else _number(rng) if f == "price" else
                  f"{rng.randint(1, 59)} minutes" if f == "eta" else rng.choice(("ok", "done", "queued", "failed"))
                  if f == "status" else f"{rng.choice('ABCDEFGH')}{rng.randint(1000, 9999)}" if f == "id" else
                  f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}")
    said = _join([f"the {f} is {v}" for f, v in res.items()])
    return res, rng.choice((f"Done: {said}.", f"{_cap(said)}.", f"The {tool.noun.replace('_', ' ')} tool says {said}."))


def _call_id(rng: random.Random) -> str:
    return f"call_{rng.getrandbits(96):024x}"


def _tool_exchange(rng: random.Random, mode: str, tools: list[Tool]) -> Exchange:
    """A question needing one call (sometimes two), the call(s), the result(s), an answer using them."""
    first = rng.choice(tools)
    calls = [(first, _arguments(rng, first))]
    if rng.random() < 0.15:
        second = first if rng.random() < 0.5 or len(tools) == 1 else rng.choice([t for t in tools if t is not first])
        calls.append((second, _arguments(rng, second)))
    asks = [_ask(rng, t, a) for t, a in calls]
    user = asks[0] if len(asks) == 1 else f"{asks[0]} Also: {asks[1][:1].lower() + asks[1][1:]}"
    tool_calls, results, answers = [], [], []
    for t, a in calls:
        cid = _call_id(rng)
        tool_calls.append({"id": cid, "type": "function",
                           "function": {"name": t.name, "arguments": json.dumps(a, ensure_ascii=False)}})
        res, said = _result(rng, t, a)
        results.append({"role": "tool", "tool_call_id": cid, "content": json.dumps(res, ensure_ascii=False)})
        answers.append(said)
    names = " and ".join(dict.fromkeys(t.name for t, _ in calls))
    why_call = rng.choice((f"I need {names} for this.", f"This needs a tool call: {names}.",
                           f"The user wants {calls[0][0].noun.replace('_', ' ')} data; I call {names}."))
    why_answer = rng.choice(("The tool answered; I report its result.", "I have the result, so I answer."))
    replies = [_assistant("", why_call if _think(mode, 0.2, rng) else "", tool_calls), *results,
               _assistant(" ".join(answers), why_answer if _think(mode, 0.0, rng) else "")]
    t0, a0 = calls[0]
    return Exchange(user, replies, {"name": t0.name, "arguments": a0,
                                    "calls": [{"name": t.name, "arguments": a} for t, a in calls]})


def _toolset(rng: random.Random, weather: bool) -> list[Tool]:
    tools: list[Tool] = []
    names: set[str] = set()
    for _ in range(rng.randint(1, 4)):
        tools.append(make_tool(rng, names))
        names.add(tools[-1].name)
    if weather:
        tools[rng.randrange(len(tools))] = weather_tool(rng)
    return tools


# -- kinds --------------------------------------------------------------------------------------------------------
def _system(rng: random.Random) -> list[dict]:
    if rng.random() < 0.75:
        return []
    return [{"role": "system", "content": rng.choice((
        "You are a helpful assistant.", "Answer briefly.", "You are m3-mini, a small helpful model.",
        "Be concise and accurate.", "You are a friendly assistant. Keep answers short."))}]


def _chat(rng: random.Random, kind: str, mode: str, exchanges: list[Exchange], tools: list[Tool] | None) -> Chat:
    messages = _system(rng)
    for i, ex in enumerate(exchanges):
        messages.append({"role": "user", "content": ex.user})
        if i < len(exchanges) - 1:  # history: what a client sends back, without the reasoning
            messages += [{k: v for k, v in m.items() if k != "reasoning_content"} for m in ex.replies]
        else:
            messages += ex.replies
    return Chat(messages, [t.spec for t in tools] if tools else None, _chat_mode(mode, rng), kind,
                exchanges[-1].expected)


def sample_arith(rng: random.Random, src: Sources) -> Chat:
    mode = _pick_mode(rng, enabled=0.4, disabled=0.3)
    return _chat(rng, "arith", mode, [_arith_exchange(rng, mode)], None)


def sample_tool(rng: random.Random, src: Sources, weather: bool | None = None) -> Chat:
    mode = _pick_mode(rng, enabled=0.2, disabled=0.2)
    weather = rng.random() < 0.06 if weather is None else weather
    tools = _toolset(rng, weather)
    if weather:
        tools_ = [t for t in tools if t.weather]
        ex = _tool_exchange(rng, mode, tools_) if rng.random() < 0.9 else _tool_exchange(rng, mode, tools)
    else:
        ex = _tool_exchange(rng, mode, tools)
    return _chat(rng, "tool", mode, [ex], tools)


def sample_no_tool(rng: random.Random, src: Sources) -> Chat:
    mode = _pick_mode(rng, enabled=0.15, disabled=0.25)
    tools = _toolset(rng, rng.random() < 0.2)
    x = rng.random()
    ex = (_arith_exchange(rng, mode) if x < 0.3 else _define_exchange(rng, mode, src) if x < 0.5
          else _chat_exchange(rng, mode, src))
    ex.expected["calls"] = []  # a grader checks that no tool was called
    return _chat(rng, "no_tool", mode, [ex], tools)


def sample_chat(rng: random.Random, src: Sources) -> Chat:
    mode = _pick_mode(rng, enabled=0.15, disabled=0.25)
    return _chat(rng, "chat", mode, [_chat_exchange(rng, mode, src)], None)


def sample_define(rng: random.Random, src: Sources) -> Chat:
    mode = _pick_mode(rng, enabled=0.15, disabled=0.25)
    return _chat(rng, "define", mode, [_define_exchange(rng, mode, src)], None)


def sample_multi_turn(rng: random.Random, src: Sources, turns: int | None = None) -> Chat:
    """Two or three exchanges; the earlier ones are history (no reasoning), the last one trains."""
    mode = rng.choice(MODES)
    turns = turns or rng.choice((2, 2, 3))
    tools = _toolset(rng, rng.random() < 0.1) if rng.random() < 0.4 else None
    exchanges = []
    for i in range(turns):
        m = mode if i == turns - 1 else "disabled"
        x = rng.random()
        ex = (_tool_exchange(rng, m, tools) if tools and x < 0.4 else _arith_exchange(rng, m) if x < 0.55
              else _define_exchange(rng, m, src) if x < 0.7 else _chat_exchange(rng, m, src))
        exchanges.append(ex)
    return _chat(rng, "multi_turn", mode, exchanges, tools)


# (what is hidden, the questions asking for it, the answer); {e} is the holder, {v} the value
NEEDLES = (
    ("The pass key of {e} is {v}.", ("What is the pass key of {e}?", "Find the pass key of {e}.",
                                     "What is {e}'s pass key?", "Which pass key belongs to {e}?"),
     "The pass key of {e} is {v}."),
    ("{e}'s PIN is {v}.", ("What is {e}'s PIN?", "Which PIN does {e} use?", "Tell me the PIN of {e}."),
     "{e}'s PIN is {v}."),
    ("The access code for room {e} is {v}.", ("What is the access code for room {e}?",
                                              "Which code opens room {e}?", "Room {e}: what's the access code?"),
     "The access code for room {e} is {v}."),
    ("Ticket {e} was issued with number {v}.", ("What number was ticket {e} issued with?",
                                                "Give me the number of ticket {e}."), "Ticket {e} has number {v}."),
    ("Project {e} uses the secret number {v}.", ("What secret number does project {e} use?",
                                                 "What is the secret number of project {e}?"),
     "Project {e} uses {v}."),
    ("Device {e} has serial number {v}.", ("What is the serial number of device {e}?",
                                           "Find the serial of device {e}."), "Device {e} has serial number {v}."),
)
PROJECTS = tuple(w.capitalize() for w in ADJECTIVES)


def _holder(rng: random.Random, needle: int) -> str:
    if needle in (0, 1):
        return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    if needle == 2:
        return f"{rng.randint(1, 40)}{rng.choice('ABCDEFGH')}"
    if needle == 3:
        return f"T-{rng.randint(100, 9999)}"
    if needle == 4:
        return f"{rng.choice(PROJECTS)} {rng.choice(NOUNS).capitalize()}"
    return f"{rng.choice('DKMQRSVX')}{rng.randint(10, 999)}"


def sample_retrieval(rng: random.Random, src: Sources, n_chars: int | None = None, n_keys: int | None = None,
                     needle: int | None = 0) -> Chat:
    """Values hidden at random places of ~n_chars of filler; the user asks for one of them. `needle`: which of
    NEEDLES (0, the default: pass keys, "The pass key of NAME is NNNNNN.", drawn exactly as before the others
    existed, so a seed gives the same chat it always gave); None draws one kind per document (prepare.py's
    retrieval set)."""
    n_chars = n_chars or int(2000 * 15 ** rng.random())  # 2k-30k characters, log-uniform
    n_keys = n_keys or min(rng.randint(8, 64), max(8, n_chars // 150))
    needle = rng.randrange(len(NEEDLES)) if needle is None else needle
    statement, questions, reply = NEEDLES[needle]
    names: list[str] = []
    while len(names) < n_keys:
        name = _holder(rng, needle)
        if name not in names and (needle == 0 or not any(name in n or n in name for n in names)):
            names.append(name)
    if needle == 0:
        keys = [f"{rng.randint(0, 999999):06d}" for _ in names]
    else:
        keys = [str(rng.randint(0, 10 ** rng.choice((4, 5, 6, 6, 6, 7)) - 1)).zfill(rng.choice((4, 6)))
                for _ in names]
    avg = sum(len(s) for s in src.sentences[:200]) / min(200, len(src.sentences)) + 1
    filler = rng.choices(src.sentences, k=max(n_keys, int(n_chars / avg)))
    slots = sorted(rng.sample(range(len(filler) + 1), n_keys))
    parts, prev = [], 0
    for slot, name, key in zip(slots, names, keys):
        parts.append(" ".join(filler[prev:slot]))
        parts.append(statement.format(e=name, v=key))
        prev = slot
    parts.append(" ".join(filler[prev:]))
    lines = needle == 0 or rng.random() < 0.7  # one value's sentence a line, or running text
    document = ("\n" if lines else " ").join(p for p in parts if p)
    target = rng.randrange(n_keys)
    name, key = names[target], keys[target]
    q = rng.choice(questions).format(e=name)
    intro = rng.choice(("Read the text below and answer the question.", "Here is a document.",
                        "Remember the pass keys in this text.", "") if needle == 0 else
                       ("Read the text below and answer the question.", "Here is a document.",
                        "Remember what this text says.", "Some records:", ""))
    user = (f"{intro}\n\n{document}\n\n{q}" if rng.random() < 0.8 else f"{q}\n\n{document}\n\nAgain: {q}").strip()
    mode = "disabled" if rng.random() < 0.5 else "adaptive"
    answer = _assistant(reply.format(e=name, v=key))
    return _chat(rng, "retrieval", mode, [Exchange(user, [answer], {"value": key, "name": name})], None)


KINDS: dict[str, Callable[..., Chat]] = {
    "arith": sample_arith, "tool": sample_tool, "no_tool": sample_no_tool, "chat": sample_chat,
    "define": sample_define, "retrieval": sample_retrieval, "multi_turn": sample_multi_turn,
}


def _plain(module: str, name: str) -> Callable[..., Chat]:
    """A kind that lives in a module of its own (requests.py, passages.py, honesty.py build on this module's
    helpers, so they are imported when first drawn)."""
    def draw(rng: random.Random, src: Sources, **kw) -> Chat:
        return getattr(importlib.import_module(f"training.{module}"), name)(rng, src, **kw)
    draw.__name__ = name
    return draw


KINDS.update({"request": _plain("requests", "sample_request"),
              "request_no_call": _plain("requests", "sample_request_no_call"),
              "passage": _plain("passages", "sample_passage"), "unknown": _plain("honesty", "sample_unknown")})
MIXTURE: dict[str, float] = {"arith": 0.13, "tool": 0.04, "no_tool": 0.04, "chat": 0.05, "define": 0.03,
                             "retrieval": 0.12, "multi_turn": 0.05, "request": 0.20, "request_no_call": 0.14,
                             "passage": 0.12, "unknown": 0.08}
"""Kinds' weights. Of the chats that offer tools, about 43 % need none (no_tool, request_no_call): a model that
sees calls after most tool lists learns to call for any message."""


def sample(rng: random.Random, kind: str, glosses: Sequence[tuple[str, str]] | None = None,
           sentences: Sequence[str] | None = None, docs: Sequence[tuple[str, str, str, str]] | None = None,
           **kw) -> Chat:
    """One chat of `kind`. `glosses` ((word, gloss) pairs), `sentences` (filler) and `docs` (library reference
    entries, passages.stdlib_entries()) replace the embedded texts; the other keywords are the kind's own
    (retrieval: n_chars, n_keys, needle; tool: weather; multi_turn: turns)."""
    if kind not in KINDS:
        raise ValueError(f"unknown chat kind {kind!r}; choose one of {sorted(KINDS)}")
    src = Sources(glosses or GLOSSES, sentences or FILLER, docs or importlib.import_module("training.passages").DOCS)
    return KINDS[kind](rng, src, **kw)


def mixture(rng: random.Random, glosses: Sequence[tuple[str, str]] | None = None,
            sentences: Sequence[str] | None = None, docs: Sequence[tuple[str, str, str, str]] | None = None) -> Chat:
    """A chat of a kind drawn with MIXTURE's weights."""
    kind = rng.choices(list(MIXTURE), weights=list(MIXTURE.values()))[0]
    return sample(rng, kind, glosses=glosses, sentences=sentences, docs=docs)
