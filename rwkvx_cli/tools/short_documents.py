"""A corpus of many short, unrelated documents from a text file, for the document-boundary ablation
(docs/training.md#should-i-reset-at-document-boundaries).

    python -m rwkvx_cli.tools.short_documents data/tinyshakespeare.txt --out runs/abl-docs/docs.jsonl [--seed 0]
        [--force]

Each paragraph (text between blank lines: in the bundled Shakespeare, one speaker's turn) becomes one
JSONL document, and the documents are shuffled with a seeded generator, so that neighbours in the
packed stream come from unrelated places of the text, as the documents of a web corpus do. Without
the shuffle each turn would answer the one before it, and carrying the state across a boundary would
be rewarded for a reason a real corpus does not have. Paragraphs are kept whole (their line breaks
included); the output is the same bytes for the same input and seed. An existing --out is replaced
only with --force.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from rwkvx_cli.entry import ArgumentParser, input_text, run_main
from rwkvx_cli.fsio import check_output, write_output


def paragraphs(text: str) -> list[str]:
    """The non-blank paragraphs of `text`, in order, without their surrounding blank lines."""
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]


def short_documents(text: str, seed: int = 0) -> list[str]:
    """The paragraphs of `text` in a seeded random order."""
    docs = paragraphs(text)
    random.Random(seed).shuffle(docs)
    return docs


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m rwkvx_cli.tools.short_documents", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a UTF-8 text file")
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write (one {'text': ...} per line)")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle's seed")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    check_output(args.out, args.force)
    docs = short_documents(input_text(args.source, "source"), args.seed)
    lines = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs)
    write_output(args.out, lines, force=args.force)
    sizes = sorted(len(d.encode("utf-8")) for d in docs)
    print(
        f"wrote {args.out}: {len(docs):,} documents, median {sizes[len(sizes) // 2]} bytes, mean "
        f"{sum(sizes) / len(sizes):.0f}, longest {sizes[-1]:,}"
    )


if __name__ == "__main__":
    run_main(main)
