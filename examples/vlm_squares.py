"""A synthetic vision task: "How many red squares?" on generated images, as a TRL conversational dataset.

Each row is {"prompt": [a user message with an image part and the question], "image": "images/<i>.png",
"answer": "<count>"}: 1 to 4 red squares and up to 2 blue ones (distractors) at random places on a white canvas.
The image path is relative to the JSONL file, as relayrl's loader reads it.

    python examples/vlm_squares.py /tmp/squares        # writes /tmp/squares/train.jsonl and its images
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw

QUESTION = "How many red squares are in the image? Answer with the number."
RED, BLUE = (220, 30, 30), (30, 60, 220)


def draw_squares(rng: random.Random, red: int, blue: int, size: int = 64, side: int = 10) -> Image.Image:
    """A white size x size image with `red` red and `blue` blue squares that do not overlap."""
    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    cells = [(x, y) for x in range(0, size - side, side + 4) for y in range(0, size - side, side + 4)]
    for i, (x, y) in enumerate(rng.sample(cells, red + blue)):
        draw.rectangle([x, y, x + side - 1, y + side - 1], fill=RED if i < red else BLUE)
    return img


def make_squares(out_dir: str | Path, n: int = 32, seed: int = 0) -> str:
    """Write n rows to OUT_DIR/train.jsonl and their images to OUT_DIR/images; returns the JSONL path."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        red = rng.randint(1, 4)
        draw_squares(rng, red, rng.randint(0, 2)).save(out / "images" / f"{i}.png")
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                     "image": f"images/{i}.png", "answer": str(red)})
    path = out / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


if __name__ == "__main__":
    print(make_squares(sys.argv[1] if len(sys.argv) > 1 else "squares"))
