"""Build a small real chat data set for the fine-tuning benchmark: verse completion from the
World English Bible (`corpus:web-bible`).

Each record asks the assistant to continue the first half of a sentence and answers with its
second half, in the `messages` format `llmopt train --data ... --format messages` reads (the
loss falls on the answers only). Deterministic: the same --n gives the same file.

    python benchmarks/finetune_chat_data.py --out runs/ft/chat.jsonl --n 400
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from llmopt.artifacts import atomic_write_text
from llmopt.data.corpus import load_text

PROMPT = "Continue this sentence from the World English Bible: {}"


def chat_records(n: int, max_chars: int = 400_000) -> list[dict]:
    text = load_text("corpus:web-bible", max_chars=max_chars)
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text)]
    records = []
    for sentence in sentences:
        words = sentence.split()
        if not 10 <= len(words) <= 40:
            continue
        half = len(words) // 2
        messages = [
            {"role": "user", "content": PROMPT.format(" ".join(words[:half]))},
            {"role": "assistant", "content": " ".join(words[half:])},
        ]
        records.append({"messages": messages})
        if len(records) == n:
            break
    if len(records) < n:
        raise SystemExit(f"only {len(records)} sentences fit; lower --n or raise --max-chars")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON-lines file to write")
    parser.add_argument("--n", type=int, default=400, help="number of conversations")
    args = parser.parse_args()
    records = chat_records(args.n)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in records))
    print(f"{len(records)} conversations -> {out}")


if __name__ == "__main__":
    main()
