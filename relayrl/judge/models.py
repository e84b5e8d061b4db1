"""Model-based rewards: an HF sequence-classification reward model (`reward_model`) and an LLM judge
(`llm_judge`, relayrl/judge/llm.py), both TRL-style batched reward functions the judge runs unchanged.

Two ways to configure them:

- A reward module (Python users, and YAML users with several model rewards): build them at its top level,
  `rm = reward_model("path/to/rm", name="rm")`, and name them by path, `judge.reward_fn: [my_rewards:rm]`, or
  pass the objects, `train(cfg, reward=[rm])`. Workers import the module and rebuild the same objects; the
  name is the metric reward/<name>, so two judges coexist.
- YAML alone: `llm_judge`, i.e. `relayrl.judge.models:llm_reward` (settings in `judge.kwargs.llm_judge`) or
  `reward_model`, i.e. `relayrl.judge.models:rm_reward` (settings in `judge.kwargs.reward_model`). judge.kwargs
  go to every reward function, so this form suits one model reward next to functions that take **kwargs.

The reward model is loaded once per worker process, on its first batch (cached per (path, device)), and
scores each prompt+completion with the chat template when its tokenizer has one (a pair of texts otherwise, as
classifier RMs without one were trained), in batches of `batch_size`. Its score is the logit of `label` (the
only logit of a one-label RM). torch and transformers are imported there, after the judge worker capped its
address space: the default judge.memory_mb=4096 holds torch, transformers and a small RM on CPU; a large RM
needs more, and CUDA needs judge.memory_mb=0 (its driver maps far more address space than it uses).
"""

from __future__ import annotations

import inspect
from typing import Any

from relayrl.judge.functions import REWARDS
from relayrl.judge.llm import LLMJudge, is_conversational, llm_judge, render_prompt

__all__ = ["LLMJudge", "RewardModel", "llm_judge", "llm_reward", "reward_model", "rm_reward"]

_loaded: dict[tuple[str, str], tuple[Any, Any]] = {}  # (path, device) -> (model, tokenizer), per worker


class RewardModel:
    """A configured sequence-classification reward model (see the module docstring); build it with
    `reward_model`."""

    def __init__(self, path: str, *, name: str = "reward_model", label: int | str | None = None,
                 batch_size: int = 8, device: str = "cpu", max_length: int | None = None,
                 module: str | None = None):
        if batch_size < 1:
            raise ValueError(f"reward_model batch_size must be >= 1, got {batch_size}")
        self.path, self.name, self.label, self.batch_size = str(path), name, label, batch_size
        self.device, self.max_length = device, max_length
        self.__name__ = name  # the metric reward/<name>
        self.__module__ = module or __name__  # where it was built: how the judge finds its import path

    def __repr__(self) -> str:
        return f"reward_model({self.path!r}, name={self.name!r})"

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        """One score per completion, computed `batch_size` at a time without gradients."""
        import torch

        model, tokenizer = load(self.path, self.device)
        index = self.label_index(model.config)
        scores: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            batch = self.encode(tokenizer, prompts[start:end], completions[start:end]).to(self.device)
            with torch.inference_mode():
                logits = model(**batch).logits
            scores += logits[:, index].float().tolist()
        return scores

    def encode(self, tokenizer: Any, prompts: list[Any], completions: list[Any]) -> Any:
        """Token ids for a batch (right-padded): the chat template over prompt + completion where there is one."""
        completions = [c[-1]["content"] if is_conversational(c) else str(c) for c in completions]
        limits = {"truncation": self.max_length is not None, "max_length": self.max_length}
        if tokenizer.chat_template:
            texts = [tokenizer.apply_chat_template(chat(p) + [{"role": "assistant", "content": c}], tokenize=False)
                     for p, c in zip(prompts, completions, strict=True)]
            return tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt", **limits)
        return tokenizer([render_prompt(p) for p in prompts], completions, padding=True, return_tensors="pt",
                         **limits)

    def label_index(self, config: Any) -> int:
        """Which logit is the score: `label` by index or name, or the only one."""
        if isinstance(self.label, int):
            return self.label
        if isinstance(self.label, str):
            if self.label not in config.label2id:
                raise ValueError(f"reward_model {self.name!r}: no label {self.label!r} (labels: {config.label2id})")
            return int(config.label2id[self.label])
        if config.num_labels != 1:
            raise ValueError(f"reward_model {self.name!r} has {config.num_labels} labels: choose one with label=")
        return 0


def chat(prompt: Any) -> list[dict[str, Any]]:
    """A prompt as chat messages (a text prompt is one user turn)."""
    return list(prompt) if is_conversational(prompt) else [{"role": "user", "content": render_prompt(prompt)}]


def load(path: str, device: str) -> tuple[Any, Any]:
    """The model and tokenizer at `path` on `device`, loaded on first use in this process (eval mode)."""
    if (path, device) not in _loaded:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.padding_side = "right"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        if model.config.pad_token_id is None:  # the classifier reads the last non-pad token of each row
            model.config.pad_token_id = tokenizer.pad_token_id
        _loaded[path, device] = model, tokenizer
    return _loaded[path, device]


def reward_model(path: str, *, name: str = "reward_model", **settings: Any) -> RewardModel:
    """A reward-model reward function (settings: label, batch_size, device, max_length). Assign it at the top
    level of a module: workers import it by path."""
    caller = inspect.currentframe()
    module = caller.f_back.f_globals.get("__name__") if caller and caller.f_back else None
    return RewardModel(path, name=name, module=module, **settings)


@REWARDS.register("llm_judge")
async def llm_reward(prompts: list[Any], completions: list[Any], *, llm_judge: dict[str, Any],
                     **columns: Any) -> list[float | None]:
    """An LLM judge configured in YAML alone: `judge.kwargs.llm_judge` holds `llm_judge`'s settings."""
    return await LLMJudge(**{"name": "llm_reward", **llm_judge})(prompts, completions, **columns)


@REWARDS.register("reward_model")
def rm_reward(prompts: list[Any], completions: list[Any], *, reward_model: dict[str, Any],
              **columns: Any) -> list[float]:
    """A reward model configured in YAML alone: `judge.kwargs.reward_model` holds `reward_model`'s settings
    (path, label, batch_size, device, max_length)."""
    settings = dict(reward_model)
    return RewardModel(settings.pop("path"), **settings)(prompts, completions, **columns)
