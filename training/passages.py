"""Questions answered from a passage placed in the prompt: the model reads the answer instead of recalling it.

    stdlib_entries()             (name, signature, first paragraph, summary) of this interpreter's standard library
                                 functions and methods, read with `ast`; the modules `reserved_module` names are left
                                 out (they are an evaluation's)
    pseudo_word(rng)             a made-up word: a gloss attached to it can only be read, never remembered
    passage_exchange(rng, ...)   a glossary or a few library reference entries, a question about one of them, the
                                 answer that copies what the entry says (or says the passage does not have it)
    sample_passage(rng, src)     a `passage` chat

Glossaries take WordNet's glosses (the caller's `glosses`), half of them under made-up words; reference entries take
the caller's `docs` (prepare.py passes stdlib_entries()). Without them the module's small embedded lists are used.
"""

from __future__ import annotations

import ast
import glob
import os
import random
import sysconfig
import zlib

from training.chats import Chat, Exchange, Sources, _assistant, _cap, _chat, _pick_mode, _think, clean_gloss


def reserved_module(module: str) -> bool:
    """The standard-library modules whose docstrings an evaluation may ask about: those whose name's CRC-32 is
    divisible by 5 (a fixed split, so neither side needs the other's list)."""
    return zlib.crc32(module.encode()) % 5 == 0


def summary(doc: str) -> str:
    """A docstring's first sentence, on one line, without its final period."""
    first = " ".join(doc.split("\n\n")[0].split())
    end = first.find(". ")
    return (first if end == -1 else first[:end + 1]).rstrip(".")


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    return f"({args.replace('self, ', '').replace('cls, ', '') if args not in ('self', 'cls') else ''})"


def stdlib_entries(max_paragraph: int = 400) -> list[tuple[str, str, str, str]]:
    """(qualified name, signature, first docstring paragraph, summary) for the public functions and methods of the
    standard library's pure-Python modules that have a short, sentence-like summary; reserved modules left out."""
    base = sysconfig.get_paths()["stdlib"]
    out = []
    for path in sorted(glob.glob(os.path.join(base, "**/*.py"), recursive=True)):
        rel = os.path.relpath(path, base)
        if any(p in rel for p in ("test", "idlelib", "site-packages", "lib2to3", "turtledemo", "__main__")):
            continue
        module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        if module.startswith("_") or "._" in module or reserved_module(module):
            continue
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        scopes = [(module, tree.body)] + [(f"{module}.{c.name}", c.body) for c in tree.body
                                          if isinstance(c, ast.ClassDef) and not c.name.startswith("_")]
        for prefix, body in scopes:
            for node in body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                if not doc:
                    continue
                s = summary(doc)
                para = " ".join(doc.split("\n\n")[0].split())
                if 20 <= len(s) <= 110 and len(para) <= max_paragraph and s[:1].isupper() and "e.g" not in s:
                    out.append((f"{prefix}.{node.name}", _signature(node), para, s))
    return out


DOCS = (  # used when the caller passes no reference entries
    ("collections.Counter.most_common", "(n=None)",
     "List the n most common elements and their counts from the most common to the least.",
     "List the n most common elements and their counts from the most common to the least"),
    ("functools.reduce", "(function, sequence, initial=_initial_missing)",
     "Apply a function of two arguments cumulatively to the items of a sequence, from left to right.",
     "Apply a function of two arguments cumulatively to the items of a sequence, from left to right"),
    ("textwrap.wrap", "(text, width=70, **kwargs)",
     "Wrap a single paragraph of text, returning a list of wrapped lines.",
     "Wrap a single paragraph of text, returning a list of wrapped lines"),
    ("os.makedirs", "(name, mode=511, exist_ok=False)",
     "Super-mkdir; create a leaf directory and all intermediate ones.",
     "Super-mkdir; create a leaf directory and all intermediate ones"),
    ("shutil.copyfile", "(src, dst, *, follow_symlinks=True)",
     "Copy data from src to dst in the most efficient way possible.",
     "Copy data from src to dst in the most efficient way possible"),
)

SYLLABLES = ("bra", "ve", "lo", "mir", "tan", "qui", "dor", "pel", "sa", "gru", "fen", "ox", "li", "mar", "tho",
             "wen", "cal", "rin", "zu", "bel", "nok", "tris", "ham", "e", "ul", "vo", "sk", "gan", "pry", "do")


def pseudo_word(rng: random.Random) -> str:
    w = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3, 3, 4))))
    return w if len(w) >= 5 else w + rng.choice(("ine", "ett", "ola", "ack"))


GLOSSARY_INTROS = ("Read this glossary.", "Here is a short word list.", "Definitions:", "From a dictionary page:",
                   "Some terms I wrote down:", "Vocabulary for my class:", "")
GLOSSARY_LINES = ("{w}: {g}.", "{w} - {g}.", "{w} (noun): {g}.", "* {w} -- {g}", "{i}. {w}: {g}")
GLOSSARY_QUESTIONS = ("What does {w} mean?", "What is a {w}, according to the list?", "Define {w} from the text.",
                      "Using these definitions, what is {w}?", "{w}?", "Tell me what the word {w} means here.",
                      "Which definition does the list give for {w}?")
GLOSSARY_ANSWERS = ("{W} means {g}.", "According to the list, {w} is {g}.", "{W}: {g}.", "The text says {w} means {g}.",
                    "Here, {w} means {g}.")
DOC_INTROS = ("Documentation:", "Here are some library functions.", "From the Python reference:",
              "Read these docs and answer.", "Library notes:", "")
DOC_QUESTIONS = ("What does {f} do?", "According to the documentation, what is {f} for?",
                 "Explain {f} briefly.", "What is the purpose of {f}?", "Describe {f} from these docs.",
                 "How do the docs describe {f}?")
DOC_ANSWERS = ("{f}: {s}.", "According to the documentation, {f} does this: {s}.", "{s}.",
               "The entry for {f} says: {s}.", "The docs say {f} will {sl}.")


def _glossary(rng: random.Random, src: Sources, mode: str) -> Exchange:
    entries = []
    while len(entries) < rng.choice((3, 4, 5, 6)):
        word, gloss = rng.choice(src.glosses)
        gloss = clean_gloss(gloss)
        if len(gloss) > 140 or not gloss:
            continue
        word = pseudo_word(rng) if rng.random() < 0.5 else word.replace("_", " ")
        if word not in [e[0] for e in entries]:
            entries.append((word, gloss))
    line = rng.choice(GLOSSARY_LINES)
    body = "\n".join(line.format(w=w, g=g, i=i + 1) for i, (w, g) in enumerate(entries))
    absent = rng.random() < 0.1
    if absent:  # a word the passage does not have: say so
        w = pseudo_word(rng)
        q = rng.choice(GLOSSARY_QUESTIONS).format(w=w)
        a = rng.choice((f"The list does not define {w}, so I don't know.",
                        f"I don't know: {w} is not in the text."))
        expected = {"value": None}
    else:
        w, g = rng.choice(entries)
        q = rng.choice(GLOSSARY_QUESTIONS).format(w=w)
        a = rng.choice(GLOSSARY_ANSWERS).format(w=w, W=_cap(w), g=g)
        expected = {"value": g}
    intro = rng.choice(GLOSSARY_INTROS)
    user = f"{intro}\n{body}\n\n{q}".strip() if rng.random() < 0.85 else f"{q}\n\n{body}"
    why = f"The passage defines {w}; I answer from it." if not absent else f"{w} is not in the passage."
    return Exchange(user, [_assistant(a, why if _think(mode, 0.05, rng) else "")], expected)


def _reference(rng: random.Random, src: Sources, mode: str) -> Exchange:
    entries = rng.sample(list(src.docs), min(len(src.docs), rng.choice((2, 3, 4))))
    style = rng.random()
    blocks = []
    for name, sig, para, _ in entries:
        if style < 0.4:
            blocks.append(f"{name}{sig}\n    {para}")
        elif style < 0.7:
            blocks.append(f".. function:: {name}{sig}\n\n   {para}")
        else:
            blocks.append(f"{name}{sig} -- {para}")
    name, _, _, s = rng.choice(entries)
    q = rng.choice(DOC_QUESTIONS).format(f=name)
    sl = s[:1].lower() + s[1:]
    a = rng.choice(DOC_ANSWERS).format(f=name, s=s, sl=sl)
    intro = rng.choice(DOC_INTROS)
    user = f"{intro}\n\n" + "\n\n".join(blocks) + f"\n\n{q}"
    why = f"The entry for {name} answers this."
    return Exchange(user.strip(), [_assistant(a, why if _think(mode, 0.05, rng) else "")], {"value": s})


def passage_exchange(rng: random.Random, mode: str, src: Sources) -> Exchange:
    return _reference(rng, src, mode) if src.docs and rng.random() < 0.5 else _glossary(rng, src, mode)


def sample_passage(rng: random.Random, src: Sources) -> Chat:
    mode = _pick_mode(rng, enabled=0.15, disabled=0.3)
    return _chat(rng, "passage", mode, [passage_exchange(rng, mode, src)], None)
