"""Special tokens typed in chat messages: control tokens (the default) or text (--escape-special-tokens).

A chat template writes its turns with control tokens (`<|im_start|>user ... <|im_end|>`) and pastes each
message's text between them; the rendered text is then tokenized as one string, so `<|im_end|>` typed in a
message becomes the real control token and the message can close its own turn and open a forged `system` one.
vLLM and SGLang tokenize the same way and keep it as their default (a fix for vLLM was closed unmerged; SGLang's
is opt-in), and clients that mean to send control tokens (a hand-built history, an agent replaying its own
turns) rely on it; so relayrl serve keeps it by default, for the same prompts token for token.

With --escape-special-tokens, every string of the request's messages and tools that holds a special token's
text is tokenized as text (`split_special_tokens`): the template's own control tokens stay control tokens,
the client's become ordinary pieces. To know where such a string lands in the rendered text, the template
renders a placeholder in its stead, which is then replaced by the string (JSON-escaped where the template
wrote it as JSON); a template that mangles the placeholder gets the request refused, never sent unescaped.
Requests without special-token text keep the plain path, token for token.
The completions APIs and /generate take the prompt as the client wrote it, control tokens and all: a raw
prompt is the client's own format. The trainer's tokenization is untouched (it never comes through here).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from relayrl.serve.errors import BadRequest


def special_texts(tok: Any) -> tuple[str, ...]:
    """The text of every special token (added tokens marked special, and the tokenizer's named ones)."""
    added = [t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if t.special]
    return tuple(sorted(set(added) | set(tok.all_special_tokens), key=len, reverse=True))


class Escaped:
    """A request's messages and tools with each string that holds special-token text replaced by a
    placeholder (`value`), and the way back from a rendering of them (`restore`)."""

    def __init__(self, value: Any, specials: tuple[str, ...]):
        self.mark = f"\ue000{secrets.token_hex(4)}:"
        self.originals: dict[str, str] = {}
        self.value = self._swap(value, specials)

    def _swap(self, value: Any, specials: tuple[str, ...]) -> Any:
        if isinstance(value, str):
            if not any(sp in value for sp in specials):
                return value
            holder = f"{self.mark}{len(self.originals)}\ue001"
            self.originals[holder] = value
            return holder
        if isinstance(value, dict):  # keys too: a schema's property names are the client's text
            return {self._swap(k, specials): v if k == "role" else self._swap(v, specials) for k, v in value.items()}
        if isinstance(value, list):
            return [self._swap(v, specials) for v in value]
        return value

    def restore(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text with the strings back, and their spans (to tokenize as text)."""
        forms = {}
        for holder, original in self.originals.items():
            forms[holder] = original
            forms[json.dumps(holder)[1:-1]] = json.dumps(original)[1:-1]  # a template that wrote it as JSON
        out, spans, at, length = [], [], 0, 0
        if forms:
            for m in re.finditer("|".join(map(re.escape, sorted(forms, key=len, reverse=True))), text):
                out += [text[at:m.start()], forms[m.group()]]
                length += m.start() - at
                spans.append((length, length + len(forms[m.group()])))
                length, at = length + len(forms[m.group()]), m.end()
        out.append(text[at:])
        restored = "".join(out)
        if self.mark in restored or json.dumps(self.mark)[1:-1] in restored:
            raise BadRequest("messages", "hold special-token text where the chat template changes the text, so it "
                             "cannot be escaped (--escape-special-tokens); send it without the special tokens")
        return restored, spans


def encode(tok: Any, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Token ids of `text`, the `spans` tokenized with special-token text as plain text."""
    if not spans:
        return tok(text, add_special_tokens=False)["input_ids"]
    ids, at = [], 0
    for a, b in spans:
        if at < a:
            ids += tok(text[at:a], add_special_tokens=False)["input_ids"]
        ids += tok(text[a:b], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        at = b
    if at < len(text):
        ids += tok(text[at:], add_special_tokens=False)["input_ids"]
    return ids
