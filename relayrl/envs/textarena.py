"""TextArena's single-player games (pyproject.toml's `envs` extra) as relayrl environments, unchanged.

```yaml
data:
  train: {source: "relayrl.envs.textarena:seeds", kwargs: {n: 1000}, answer_key: null}
agent:
  kind: env
  kwargs: {env: "relayrl.envs.textarena:TextArenaEnv", env_kwargs: {game: "GuessTheNumber-v0"}, max_turns: 10}
```

An episode is one game: `reset(row)` makes the game with `textarena.make` (its registered default wrappers, so an
action is formatted as TextArena's own agents' are), starts it with the row's seed and returns the player's
prompt as a user message; `step(text)` plays the model's text as the action and returns what the game said since
(its own echo of the action dropped: the chat already holds it), and, when the game is over, TextArena's reward for
player 0. Turns before the end score None, so with `reward: sum` or `last` the episode's reward is the game's.
A game that `agent.kwargs.max_turns` cuts off before it ends has no reward (the judge's, if one is set, else the
sample is rejected): set max_turns to the game's own turn limit.

Seeding: a row's `seed` (an int), else a hash of the row, seeds the game, so the samples of a GRPO group play the
same game. TextArena draws from the process-wide `random` (and, in a few games, numpy's) generator, which the
episodes running in threads would otherwise share: each episode keeps its own generator state, swapped in under a
lock around every call into the game, so a seed gives the same game and the same moves whatever else runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from relayrl.common.errors import install_hint

try:
    import textarena
    from textarena.core import GAME_ID, ObservationType
    from textarena.state import SinglePlayerState
except ImportError as e:  # the envs extra is optional: say how to get it
    raise ModuleNotFoundError(f"relayrl.envs.textarena needs TextArena: {install_hint('envs')} ({e})",
                              name="textarena") from e

Message = dict[str, Any]
_RNG_LOCK = threading.Lock()  # TextArena uses the global generators: one episode's calls at a time


def seeds(n: int = 1000, start: int = 0, game: str | None = None) -> list[dict[str, Any]]:
    """Rows for `data.train.source: relayrl.envs.textarena:seeds` (`kwargs: {n, start}`, `answer_key: null`):
    one game per row, by its `seed`. The `question` is only a label (reset replaces the prompt with the game's)."""
    label = game or "textarena game"
    return [{"question": f"{label}, seed {s}", "seed": s} for s in range(start, start + n)]


def row_seed(row: dict[str, Any]) -> int:
    """The row's `seed`, else a stable hash of the row: every sample of a row (its GRPO group) plays one game."""
    seed = row.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    text = json.dumps(row, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


class TextArenaEnv:
    """One TextArena single-player game per episode (module docstring): `game` is its registered id
    (e.g. "GuessTheNumber-v0", "TowerOfHanoi-v0"), `game_kwargs` override its registered arguments."""

    def __init__(self, game: str = "GuessTheNumber-v0", game_kwargs: dict[str, Any] | None = None):
        self.game, self.game_kwargs = game, dict(game_kwargs or {})
        self._random: Any = None  # this episode's `random` state, swapped in around each call
        self._numpy: Any = None

    def reset(self, row: dict[str, Any]) -> list[Message]:
        """Make and start the game with the row's seed; its opening observation is the first user message."""
        seed = row_seed(row)
        self._random, self._numpy = random.Random(seed).getstate(), np.random.RandomState(seed).get_state()
        with self._own_generators():
            self.env = textarena.make(self.game, **self.game_kwargs)
            self.env.reset(num_players=1, seed=seed)
            if not isinstance(self.env.state, SinglePlayerState):  # some multi-player games take 1 player silently
                raise ValueError(f"{self.game} is a {type(self.env.state).__name__} game: TextArenaEnv plays "
                                 "single-player games (the model is player 0, with no opponent)")
            return [{"role": "user", "content": self._new_observations()}]

    def step(self, assistant_text: str) -> tuple[list[Message], float | None, bool]:
        """Play the text as player 0's action: (the game's answer, its reward for player 0 when over, done)."""
        with self._own_generators():
            done, _ = self.env.step(action=assistant_text)
            text = self._new_observations()
            if not done:
                return [{"role": "user", "content": text}], None, False
            rewards, _ = self.env.close()
        return [{"role": "user", "content": text}] if text else [], float(rewards[0]), True

    def _new_observations(self) -> str:
        """What the game told player 0 since the last call, as TextArena's LLM wrapper writes it ("[GAME] ..."),
        less the echo of its actions (already in the chat as assistant turns; some games send it as GAME's)."""
        lines = []
        for sender, message, kind in self.env.state.get_current_player_observation():
            if kind == ObservationType.PLAYER_ACTION:  # single-player: every action is the model's
                continue
            lines.append(message if kind == ObservationType.PROMPT else
                         f"[{'GAME' if sender == GAME_ID else f'Player {sender}'}] {message}")
        return "\n".join(lines)

    @contextlib.contextmanager
    def _own_generators(self) -> Iterator[None]:
        """Run a game call on this episode's generator states (module docstring), saving them after."""
        with _RNG_LOCK:
            outer_random, outer_numpy = random.getstate(), np.random.get_state()
            random.setstate(self._random)
            np.random.set_state(self._numpy)
            try:
                yield
            finally:
                self._random, self._numpy = random.getstate(), np.random.get_state()
                random.setstate(outer_random)
                np.random.set_state(outer_numpy)
