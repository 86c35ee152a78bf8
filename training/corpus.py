"""Build m3-mini's text corpus from sources any Debian machine can fetch, pinned by version and sha256.

    python -m training.corpus --out data/corpus

Sources (all permissively licensed; docs/m3_mini.md lists the licenses):
- the Python 3.11 documentation's reST sources (package python3.11-doc; PSF-2.0 / 0BSD), without `whatsnew/`;
- fortunes (package fortunes and fortunes-min; BSD), the `off/` (offensive) collection left out;
- WordNet 3.0 glosses (package wordnet-base; the WordNet license), as "lemma: gloss" lines, also used by the chat
  generator for definitions;
- the docstrings of this interpreter's standard library (PSF-2.0), read with `ast`.

Each package is fetched with `apt-get download NAME=VERSION`, its sha256 checked, and unpacked with `dpkg -x`.
A security update that replaces a version makes the download fail loudly rather than change the corpus.
Writes one UTF-8 text file per source, documents separated by a line holding only "\\x1e" (record separator).
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import os
import re
import subprocess
import sysconfig
import tempfile

DOC_SEP = "\n\x1e\n"

# name -> (version, sha256 of the .deb) on Debian bookworm (main and bookworm-security)
PACKAGES = {
    "python3.11-doc": ("3.11.2-6+deb12u9", "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be"),
    "fortunes": ("1:1.99.1-7.3", "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5"),
    "fortunes-min": ("1:1.99.1-7.3", "9eed5b45064e41133dae0967cf3a17588ad77c014fcc7bf1527fa3ea48e44d07"),
    "wordnet-base": ("1:3.0-37", "61060d960f9ada8fa120872312eccd3ecebfbab8c4579e4f5a74e1cf67620752"),
}


def fetch(root: str, debs: str | None = None) -> None:
    """Download (or take from `debs`) every pinned package, check its sha256 and unpack it under `root`."""
    os.makedirs(root, exist_ok=True)
    work = debs or tempfile.mkdtemp(prefix="m3mini-debs-")
    for name, (version, sha) in PACKAGES.items():
        found = [p for p in glob.glob(os.path.join(work, f"{name}_*.deb"))
                 if hashlib.sha256(open(p, "rb").read()).hexdigest() == sha]
        if not found:
            subprocess.run(["apt-get", "download", f"{name}={version}"], cwd=work, check=True,
                           stdout=subprocess.DEVNULL)
            found = [p for p in glob.glob(os.path.join(work, f"{name}_*.deb"))
                     if hashlib.sha256(open(p, "rb").read()).hexdigest() == sha]
        if not found:
            raise SystemExit(f"{name}={version}: no .deb with sha256 {sha} (was the version replaced?)")
        subprocess.run(["dpkg", "-x", found[0], root], check=True)


def python_docs(root: str) -> list[str]:
    base = os.path.join(root, "usr/share/doc/python3.11/html/_sources")
    docs = []
    for path in sorted(glob.glob(os.path.join(base, "**/*.txt"), recursive=True)):
        if "/whatsnew/" in path:
            continue
        text = open(path, encoding="utf-8", errors="replace").read()
        text = re.sub(r"\n{3,}", "\n\n", text)
        docs.append(text.strip())
    return docs


def fortunes(root: str) -> list[str]:
    base = os.path.join(root, "usr/share/games/fortunes")
    out = []
    for path in sorted(glob.glob(os.path.join(base, "*"))):
        if os.path.isdir(path) or path.endswith((".dat", ".u8")):
            continue
        text = open(path, encoding="utf-8", errors="replace").read()
        out.extend(f.strip() for f in text.split("\n%\n") if f.strip())
    return out


def wordnet_glosses(root: str) -> list[tuple[str, str]]:
    """(lemma, gloss) for every noun, verb and adjective synset's first lemma; examples in quotes dropped."""
    base = os.path.join(root, "usr/share/wordnet")
    out = []
    for pos in ("noun", "verb", "adj"):
        for line in open(os.path.join(base, f"data.{pos}"), encoding="utf-8", errors="replace"):
            if line.startswith("  ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            lemma = parts[4].replace("_", " ")
            lemma = re.sub(r"\(.*\)$", "", lemma)
            gloss = gloss.split(";")[0].strip()
            if len(gloss) > 8 and not gloss.startswith('"'):
                out.append((lemma, gloss))
    return out


def stdlib_docstrings() -> list[str]:
    base = sysconfig.get_paths()["stdlib"]
    out = []
    for path in sorted(glob.glob(os.path.join(base, "**/*.py"), recursive=True)):
        if any(part in path for part in ("/test/", "/tests/", "/idlelib/", "/site-packages/", "lib2to3")):
            continue
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    out.append(doc)
    return out


def build(out: str, debs: str | None = None) -> dict[str, int]:
    root = os.path.join(out, "root")
    fetch(root, debs)
    os.makedirs(out, exist_ok=True)
    sizes = {}
    sources = {
        "python_docs": python_docs(root),
        "fortunes": fortunes(root),
        "wordnet": [f"{lemma}: {gloss}." for lemma, gloss in wordnet_glosses(root)],
        "stdlib_docstrings": stdlib_docstrings(),
    }
    for name, docs in sources.items():
        text = DOC_SEP.join(docs)
        with open(os.path.join(out, f"{name}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        sizes[name] = len(text.encode())
    return sizes


def wordnet_glosses_from_text(path: str) -> list[tuple[str, str]]:
    """The (lemma, gloss) pairs back from the corpus's wordnet.txt."""
    out = []
    for doc in read_docs(path):
        lemma, _, gloss = doc.partition(": ")
        out.append((lemma, gloss.rstrip(".")))
    return out


def read_docs(path: str) -> list[str]:
    return [d for d in open(path, encoding="utf-8").read().split(DOC_SEP) if d]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/corpus")
    ap.add_argument("--debs", help="a folder that may already hold the pinned .deb files")
    args = ap.parse_args()
    for name, size in build(args.out, args.debs).items():
        print(f"{name:20s} {size / 1e6:6.2f} MB")


if __name__ == "__main__":
    main()
