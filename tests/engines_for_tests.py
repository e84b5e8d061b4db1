"""A real LocalEngine that halts itself mid-sequence, so tests act between two decode steps
deterministically instead of racing the engine thread (a fast machine finishes 40 tiny-model
tokens before a polling loop notices the 10th)."""

from __future__ import annotations

import threading

from relayrl.engine.local import LocalEngine


class HaltingEngine(LocalEngine):
    """Pauses itself once `halt_at` tokens were generated; `halted` is set then. Call resume()."""

    def __init__(self, *args, halt_at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.halt_at = halt_at
        self.halted = threading.Event()

    def _sample_and_append(self, seqs, logits) -> None:
        super()._sample_and_append(seqs, logits)
        if not self.halted.is_set() and self.stats["generated_tokens"] >= self.halt_at:
            with self._cond:
                self._paused = True
            self.halted.set()
