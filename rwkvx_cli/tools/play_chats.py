"""Conversations made from a play, for the fine-tuning demonstrations (docs/training.md#state-tuning): no
download, the bundled Shakespeare is enough.

    python -m rwkvx_cli.tools.play_chats data/tinyshakespeare.txt --out runs/data/shakespeare-chats.jsonl
        [--turns 2] [--seed 0] [--force]

Each speech (a paragraph: the speaker's name on its own line, then the lines spoken) with at least two lines
becomes one conversation: the user says its first line and the assistant answers with the next, then the user
says the third and the assistant the fourth, up to --turns exchanges (an odd last line is left out). The
conversations are shuffled with a seeded generator and written as JSONL `{"messages": [...]}` records, which
`data prepare` renders through a chat template (the G1 one by default) with a loss mask over the replies. The
output is the same bytes for the same input, turns and seed; an existing --out is replaced only with --force.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rwkvx_cli.entry import ArgumentParser, at_least, input_text, run_main
from rwkvx_cli.fsio import check_output, write_output
from rwkvx_cli.tools.short_documents import paragraphs


def conversations(text: str, turns: int = 2, seed: int = 0) -> list[dict]:
    """The conversations of `text`'s speeches (see the module), in a seeded random order."""
    out = []
    for speech in paragraphs(text):
        lines = [line.strip() for line in speech.split("\n")[1:] if line.strip()]  # the speaker's name left out
        pairs = min(turns, len(lines) // 2)
        if pairs == 0:
            continue
        messages = []
        for i in range(pairs):
            messages.append({"role": "user", "content": lines[2 * i]})
            messages.append({"role": "assistant", "content": lines[2 * i + 1]})
        out.append({"messages": messages})
    random.Random(seed).shuffle(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m rwkvx_cli.tools.play_chats", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a play as UTF-8 text: speeches separated by blank lines")
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    parser.add_argument("--turns", type=at_least(1), default=2, help="exchanges per conversation at most (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle's seed")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    check_output(args.out, args.force)
    chats = conversations(input_text(args.source, "source"), args.turns, args.seed)
    if not chats:
        parser.error(f"{args.source} has no speech of two lines or more (a name line, then the lines spoken)")
    lines = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats)
    write_output(args.out, lines, force=args.force)
    replies = sum(len(c["messages"]) // 2 for c in chats)
    print(f"wrote {args.out}: {len(chats):,} conversations, {replies:,} replies, {len(lines.encode()):,} bytes")


if __name__ == "__main__":
    run_main(main)
