"""Image columns in the data loader (paths, bytes, `datasets` Image values; TRL's image content parts), the prompt
built by the tiny VLM's processor, and bad images refused with the row and column named before any model loads:
real files in tmp_path, the tiny VLM's real processor."""

import io
import json
import struct
import zlib

import pytest
from PIL import Image

from relayrl.common.errors import InputError
from relayrl.config.schema import DatasetConfig, PromptConfig, load_run_config
from relayrl.data import DataManager, PromptBuilder, load_rows
from relayrl.models.vision import load_processor
from relayrl.run.build import build

ASK = "How many red squares?"


def png(color=(255, 0, 0), size=(20, 12)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (one empty IDAT): what a decompression bomb's header looks like."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def image_prompt(text=ASK):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def test_image_columns_in_every_form_become_checked_bytes_and_image_parts(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png())
    src = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": image_prompt(), "image": "img/a.png", "answer": "1"},  # a path, from the file's folder
        {"prompt": ASK, "images": [{"bytes": None, "path": str(tmp_path / "img" / "a.png")}], "answer": "1"},
    ])
    rows = load_rows(DatasetConfig(source=src))
    assert [r["images"] for r in rows] == [[png()], [png()]] and "image" not in rows[0]
    # TRL's content parts are kept; a text prompt gets an image part before its text (as TRL prepares it)
    assert rows[0]["prompt_messages"] == image_prompt() == rows[1]["prompt_messages"]
    assert rows[0]["question"] == ASK
    # a function source's PIL images and raw bytes
    from relayrl.data.images import read_images
    assert read_images("r", {"images": [Image.new("RGB", (3, 3)), png()]}, None)[1] == png()


def test_prompt_is_built_by_the_processor_and_samples_carry_the_images(tmp_path, tiny_vlm_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": image_prompt(), "images": [str(tmp_path / "a.png")],
                                              "answer": "1"}])
    (tmp_path / "a.png").write_bytes(png())
    rows = load_rows(DatasetConfig(source=src))
    processor = load_processor(tiny_vlm_path)
    builder = PromptBuilder(processor.tokenizer, PromptConfig(), DatasetConfig(source=src), processor)
    ids = builder(rows[0])
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_token) == 16  # the processor expanded the template's one placeholder
    assert "<image>" in builder.text(rows[0]) and ASK in builder.text(rows[0])
    group = DataManager(rows, builder, group_size=2, shuffle=False).sample_from_dataset()
    assert [s.images for s in group] == [[png()], [png()]] and group[0].prompt_ids == ids


@pytest.mark.parametrize("image, message", [
    (b"not an image at all", r"d.jsonl:1: column 'image': not a readable image"),
    (png()[:40], r"d.jsonl:1: column 'image': not a readable image"),  # truncated
    (png_header_only(5000, 5000), r"d.jsonl:1: column 'image': image of 5000 x 5000 pixels is over the limit"),
    (png_header_only(100_000, 100_000), r"d.jsonl:1: column 'image': image (of 100000 x 100000 pixels is over|"
                                        r"refused as a decompression bomb)"),
])
def test_bad_images_name_the_row_and_column(tmp_path, image, message):
    (tmp_path / "x.png").write_bytes(image)
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": ASK, "image": "x.png", "answer": "1"}])
    with pytest.raises(InputError, match=message):
        load_rows(DatasetConfig(source=src))


def test_missing_image_and_mismatched_parts_are_named(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": ASK, "image": "nope.png", "answer": "1"}])
    with pytest.raises(InputError, match=r"d.jsonl:1: column 'image': cannot read image file .*nope.png"):
        load_rows(DatasetConfig(source=src))
    (tmp_path / "a.png").write_bytes(png())
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": ASK}]}]
    src = write_jsonl(tmp_path / "e.jsonl", [{"prompt": two, "image": "a.png", "answer": "1"}])
    with pytest.raises(InputError, match=r"e.jsonl:1: .*hold 2 image parts and the row has 1 images"):
        load_rows(DatasetConfig(source=src))
    bad = [{"role": "user", "content": [{"type": "video"}]}]
    src = write_jsonl(tmp_path / "f.jsonl", [{"prompt": bad, "answer": "1"}])
    with pytest.raises(InputError, match=r"f.jsonl:1: .*message 0, content part 0: expected"):
        load_rows(DatasetConfig(source=src))


def test_images_for_a_text_only_model_fail_before_it_loads(tmp_path, tiny_path):
    (tmp_path / "a.png").write_bytes(png())
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": ASK, "image": "a.png", "answer": "1"}])
    cfg = load_run_config(None, [f"model.path={tiny_path}", f"data.train.source={src}",
                                 f"run.output_dir={tmp_path}"])
    with pytest.raises(InputError, match=r"data.train: row 0 has images, but model .* is text-only"):
        build(cfg)


def test_a_datasets_image_column_is_read_undecoded_and_checked(tmp_path):
    from datasets import Dataset, Features, Value
    from datasets import Image as ImageFeature

    features = Features({"prompt": Value("string"), "image": ImageFeature(), "answer": Value("string")})
    Dataset.from_dict({"prompt": [ASK, ASK], "image": [{"bytes": png(), "path": None},
                                                       {"bytes": png_header_only(5000, 5000), "path": None}],
                       "answer": ["1", "2"]}, features=features).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(DatasetConfig(source=str(tmp_path / "ds"), size=1))[0]["images"] == [png()]
    with pytest.raises(InputError, match=r"ds\[train\]\[1\]: column 'image': image of 5000 x 5000 pixels"):
        load_rows(DatasetConfig(source=str(tmp_path / "ds")))
