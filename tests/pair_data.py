"""Synthetic preference pairs and word text for the --objective tests (CPU and GPU)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["apple", "river", "stone", "cloud", "music", "light", "paper", "garden", "window"]
WORDS += ["silver"]


def write_pairs(path: Path, n: int = 300, seed: int = 0) -> str:
    """`n` pairs as jsonl: the chosen answer repeats the prompt's words, the rejected one not."""
    r = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            w = r.sample(WORDS, 3)
            row = {
                "prompt": f"List: {' '.join(w)}. Repeat:",
                "chosen": " " + " ".join(w) + ".",
                "rejected": " " + " ".join(r.sample(WORDS, 3)) + "!",
            }
            f.write(json.dumps(row) + "\n")
    return str(path)
