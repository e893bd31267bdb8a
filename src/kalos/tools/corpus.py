"""A real text corpus that every Python has: CPython's ``pydoc_data.topics`` help texts, as passages.

``pydoc_data.topics.topics`` maps a help topic ("with", "exceptions", "formatstrings", ...) to
the language reference text ``help()`` shows for it: about 80 topics, 460 KB of English
prose and grammar (some topics share sections; each passage is kept once). :func:`passages` splits it into retrieval-sized passages: each topic into
its sections (a line underlined with ``*``, ``=`` or ``-`` starts one), each section into
paragraphs (blank-line separated), and consecutive paragraphs of one section are joined up
to ``max_chars``. A passage starts with its section title, so a passage read alone still
says what it is about. The split is deterministic for one Python version.

``python -m kalos.tools.corpus --out passages.jsonl --passages 100000`` writes a JSONL file for
``kalos import`` (the passages repeated, each repeat numbered, to reach the size asked for;
``--vectors`` adds precomputed embeddings).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = ["Passage", "passages", "QUESTIONS", "main"]

#: Questions an agent working on Python code might ask itself (the demo's recall loop).
QUESTIONS = [
    "How do I make sure a file gets closed even if an exception happens?",
    "What happens when a generator function is called?",
    "How do I format a float with two decimals in an f-string?",
    "Can a function have default argument values, and when are they evaluated?",
    "How does Python decide which method a class with several base classes uses?",
    "What does the global statement do?",
    "How do I catch several kinds of exception in one except clause?",
    "What is the difference between 'is' and '=='?",
    "How do async functions and await work?",
    "What does the walrus operator := do?",
    "How do I slice a list backwards?",
    "What makes an object usable as a dictionary key?",
    "How does pattern matching with match and case work?",
    "What is the order of precedence of the boolean operators?",
    "How do I define a property with a getter and a setter?",
    "What does the yield from expression do?",
]

_UNDERLINE = re.compile(r"^\s*([*=\-~^])\1{3,}\s*$")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


@dataclass(frozen=True)
class Passage:
    """One passage: ``text`` (title first), its help ``topic``, section ``title`` and ``part`` number."""

    text: str
    topic: str
    title: str
    part: int

    def metadata(self) -> dict[str, object]:
        return {"source": "pydoc_data.topics", "topic": self.topic, "title": self.title, "part": self.part}


def _sections(topic: str, body: str) -> Iterator[tuple[str, str]]:
    """(title, text) per section; a topic without headings is one section titled by its name."""
    lines = body.splitlines()
    title, start = topic, 0
    for i, line in enumerate(lines):
        if i > 0 and _UNDERLINE.match(line) and lines[i - 1].strip():
            text = "\n".join(lines[start : i - 1]).strip()
            if text:
                yield title, text
            title, start = lines[i - 1].strip(), i + 1
    text = "\n".join(lines[start:]).strip()
    if text:
        yield title, text


def passages(max_chars: int = 700) -> list[Passage]:
    """The help topics as passages of at most about ``max_chars`` characters (a paragraph longer
    than that stays whole; the embedder truncates what it cannot read)."""
    from pydoc_data.topics import topics

    out: list[Passage] = []
    seen: set[str] = set()  # several topics share sections ("assignment" and "augassign", ...): keep one copy
    for topic in sorted(topics):
        part = 0
        for title, text in _sections(topic, topics[topic]):
            chunk: list[str] = []
            size = 0
            paragraphs = [p.strip("\n") for p in _PARAGRAPH_BREAK.split(text) if p.strip()]
            for para in paragraphs + [None]:  # None flushes the last chunk
                if chunk and (para is None or size + len(para) > max_chars):
                    passage = f"{title}\n\n" + "\n\n".join(chunk)
                    if passage not in seen:
                        seen.add(passage)
                        out.append(Passage(passage, topic, title, part))
                        part += 1
                    chunk, size = [], 0
                if para is not None:
                    chunk.append(para)
                    size += len(para) + 2
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kalos.tools.corpus",
        description="Write the pydoc help-topic passages as JSONL for `kalos import` (benchmarks, examples).",
    )
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--passages", type=int, default=0,
                        help="rows to write: the passages repeated (each repeat numbered) up to this many; "
                        "0 = each passage once (default)")
    parser.add_argument("--vectors", action="store_true",
                        help="add a 'vector' column embedded with the default embedder (needs pip install 'kalos-recall[embed]')")
    parser.add_argument("--max-chars", type=int, default=700, help="passage size (default: %(default)s)")
    args = parser.parse_args(argv)
    base = passages(args.max_chars)
    n = args.passages or len(base)
    vectors = None
    if args.vectors:
        from kalos.client.embed import default_embedder

        vectors = default_embedder().embed([p.text for p in base])
    with args.out.open("w", encoding="utf-8") as f:
        for i in range(n):
            p = base[i % len(base)]
            copy = i // len(base)
            text = p.text if copy == 0 else f"{p.text}\n\n(copy {copy})"
            row: dict[str, object] = {"text": text, "metadata": {**p.metadata(), "copy": copy}}
            if vectors is not None:
                row["vector"] = [round(float(x), 7) for x in vectors[i % len(base)]]
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    # Fewer rows than passages are the first n, each distinct.
    print(f"wrote {n:,} rows ({min(n, len(base)):,} distinct passages) to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
