"""Token-exact multi-turn continuation with a tokenizer's chat template.

A multi-turn agent must not decode the model's output and re-encode the conversation: tokenizers do
not round-trip (and templates may rewrite history), so the trained sequence would differ from what the
model saw. Instead the agent keeps the token ids the engine produced and appends the ids of the text
it adds. `continuation_ids` computes those ids once: the exact template text that follows an
assistant turn's end-of-turn token when `messages` (feedback, tool results) come next, up to and
including the next assistant header.
"""

from __future__ import annotations

_PROBE = "\u2063relayrl-probe\u2063"  # invisible separators: text no real answer contains


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an assistant turn (the one the engine stops on)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos token: cannot tell where an assistant turn ends")
    return int(tokenizer.eos_token_id)


def continuation_text(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """Template text between an assistant turn's end-of-turn token and the next assistant turn's content."""
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}]
    kw = {"tools": tools} if tools else {}
    base = tokenizer.apply_chat_template(probe, tokenize=False, **kw)
    full = tokenizer.apply_chat_template(probe + messages, tokenize=False, add_generation_prompt=True, **kw)
    marker = _PROBE + tokenizer.eos_token
    end = base.rfind(marker)
    if end < 0 or not full.startswith(base):
        raise ValueError("the chat template does not end assistant turns with the eos token or rewrites earlier "
                         "turns when messages are added; multi-turn agents need a prefix-stable template")
    return base[end + len(marker):] + full[len(base):]


def continuation_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Ids to append after the end-of-turn token to add `messages` and open the next assistant turn."""
    return tokenizer(continuation_text(tokenizer, messages, tools), add_special_tokens=False)["input_ids"]
