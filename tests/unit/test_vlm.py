"""A vision-language policy in the engine and the trainer, on the tiny random Idefics3: the engine generates from the
prompt's merged embeddings, the trainer recomputes the same logprobs from the same image (one sample per row and
shared-prompt rows), and two prompts that differ only in their image share nothing."""

import io
import os
import time

import pytest
import torch
from PIL import Image

from relayrl.cli import main
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import load_model
from relayrl.models.vision import load_processor
from relayrl.sample import Sample
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.packer import Packer

# a system prompt before the image: prompts admitted together share their start up to the image (relayrl.engine.prefill)
ASK = [{"role": "system", "content": "You count the shapes in a picture and answer with one number."},
       {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many red squares?"}]}]


def png(color) -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", (48, 40), (255, 255, 255))
    img.paste(Image.new("RGB", (12, 12), color), (8, 8))
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(tiny_vlm_path):
    processor = load_processor(tiny_vlm_path)
    text = processor.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    images = [png((255, 0, 0)), png((0, 0, 255))]
    prompt = processor(text=[text], images=[[Image.open(io.BytesIO(images[0]))]])["input_ids"][0]
    engine = LocalEngine.from_pretrained(tiny_vlm_path, dtype="float32")
    yield engine, TrainEngine(load_model(tiny_vlm_path)), [int(t) for t in prompt], images
    engine.close()


def generate(engine, prompt, images, seeds):
    """One request per (image, seed), submitted together: a batch whose prompts have the same tokens."""
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, seed=s) for s in seeds]
    futures = [engine.submit(prompt, p, images=(img,)) for img in images for p in params]
    return [f.result() for f in futures]


def test_engine_and_trainer_logprobs_agree_on_the_same_image(vlm):
    engine, trainer, prompt, images = vlm
    outs = generate(engine, prompt, images, seeds=[1, 2])
    samples = []
    for k, out in enumerate(outs):
        s = Sample(prompt_ids=prompt, images=[images[k // 2]])
        s.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason)
        samples.append(s)
    behav = torch.tensor([lp for s in samples for lp in s.logprobs])
    for share in (False, True):  # shared-prompt rows: a row per image, its group's responses after one prompt
        batch = Packer(4096, 0, share_prompt=share).pack(samples)
        if share:
            assert [mb.input_ids.shape[0] for mb in batch.micro_batches] == [2]  # two images: two prompt rows
        for mb in batch.micro_batches:
            batch.scatter("logp", mb, trainer.forward_logprobs(mb))
        assert (batch.flat("logp") - behav).abs().mean() < 1e-4
    # the image matters: the same tokens scored with the other image are another distribution
    swapped = [Sample(prompt_ids=prompt, images=[images[1 - k // 2]], response_ids=s.response_ids,
                      loss_mask=s.loss_mask) for k, s in enumerate(samples)]
    batch = Packer(4096, 0).pack(swapped)
    (mb,) = batch.micro_batches
    assert (trainer.forward_logprobs(mb) - behav).abs().mean() > 1e-3


def test_prompts_that_differ_only_in_their_image_share_nothing(vlm):
    engine, _, prompt, images = vlm
    before = engine.stats["prefill_tokens"]
    together = generate(engine, prompt, images, seeds=[5])  # same tokens; their start is shared up to the image
    first_image = prompt.index(engine.vision.token_id)
    computed = engine.stats["prefill_tokens"] - before  # the start once (or reused), each prompt from its image on
    assert 2 * (len(prompt) - first_image) <= computed <= 2 * len(prompt) - first_image
    alone = [generate(engine, prompt, [img], seeds=[5])[0] for img in images]
    for a, b in zip(together, alone):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert together[0].logprobs != together[1].logprobs


def test_a_trajectory_reuses_its_parked_prefix_only_with_the_same_images(vlm):
    engine, _, prompt, images = vlm
    params = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=1)
    first = engine.submit(prompt, params, rid="traj", images=(images[0],)).result()
    turn = prompt + first.output_ids + [5, 6]  # the next turn's prompt extends the first's tokens
    before = engine.stats["reused_tokens"]
    second = engine.submit(turn, params, rid="traj", images=(images[1],)).result()  # another image: no reuse
    assert engine.stats["reused_tokens"] == before
    engine.submit(turn + second.output_ids + [7], params, rid="traj", images=(images[1],)).result()
    assert engine.stats["reused_tokens"] - before == len(turn) + len(second.output_ids) - 1


def test_images_without_image_tokens_and_image_tokens_without_images_are_refused(vlm, tiny_path):
    engine, _, prompt, images = vlm
    with pytest.raises(ValueError, match="no image token"):
        engine.submit([5, 6, 7], SamplingParams(max_new_tokens=2), images=(images[0],))
    with pytest.raises(ValueError, match="image tokens but no images"):
        engine.submit(prompt, SamplingParams(max_new_tokens=2))
    text = LocalEngine(load_model(tiny_path), eos_token_ids=[2])
    try:
        with pytest.raises(ValueError, match="takes no images"):
            text.submit([5, 6, 7], SamplingParams(max_new_tokens=2), images=(images[0],))
    finally:
        text.close()


def test_tiny_vlm_builds_in_seconds_with_its_processor(tmp_path, capsys):
    t0 = time.perf_counter()
    assert main(["models", "tiny-vlm", str(tmp_path / "vlm")]) == 0
    assert time.perf_counter() - t0 < 10
    folder = tmp_path / "vlm"
    assert sum(f.stat().st_size for f in folder.iterdir()) < 50 * 2**20
    processor = load_processor(folder)
    assert type(processor).__name__ == "Idefics3Processor" and processor.image_seq_len == 16
    assert "<image>" in processor.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    assert os.fspath(folder) in capsys.readouterr().out
