"""Existing environments, unchanged, through EnvAgent: TextArena's single-player games (relayrl/envs/textarena.py)
played by hand on scripted episodes (the game's own reward for a known win and loss), seeded per row, isolated from
each other's random draws, and trained on the tiny model through the loop."""

import json
import random
import re
import threading

import pytest

from relayrl.common.files import read_jsonl
from relayrl.envs import check_env_class
from relayrl.run.loop import train

textarena = pytest.importorskip("textarena")  # the envs extra, which `dev` installs
from relayrl.envs.textarena import TextArenaEnv, row_seed, seeds  # noqa: E402

HANOI_3 = ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]", "[B C]", "[A C]"]  # the 7-move solution for 3 disks


def play(env, actions):
    """Each step's (messages, reward, done), stopping at the first done."""
    out = []
    for a in actions:
        out.append(env.step(a))
        if out[-1][2]:
            break
    return out


def test_tower_of_hanoi_won_and_lost_by_script():
    env = TextArenaEnv("TowerOfHanoi-v0", game_kwargs={"num_disks": 3})
    check_env_class(TextArenaEnv, {"game": "TowerOfHanoi-v0", "game_kwargs": {"num_disks": 3}})
    (opening,) = env.reset({"seed": 0})
    assert opening["role"] == "user" and "Tower of Hanoi" in opening["content"] and "[A C]" in opening["content"]
    steps = play(env, HANOI_3)
    assert len(steps) == 7 and [s[1] for s in steps] == [None] * 6 + [1.0] and steps[-1][2]  # a win scores 1
    assert all(not done for _, _, done in steps[:-1])
    assert "You moved disk 1 from A to C" in steps[0][0][0]["content"]
    assert "[A C]" not in steps[0][0][0]["content"]  # the game's echo of the model's move is not repeated
    lost = TextArenaEnv("TowerOfHanoi-v0", game_kwargs={"num_disks": 3})
    lost.reset({"seed": 0})
    first, second = play(lost, ["[B C]", "[B C]"])  # moving from an empty tower, twice: the second ends it
    assert first[1:] == (None, False) and "invalid move" in first[0][0]["content"]
    assert second[1:] == (0.0, True)  # TextArena's score of a game lost on invalid moves with nothing solved


def guess(env):
    """Binary search on the game's hints: the number is found within GuessTheNumber's 10 turns."""
    lo, hi, steps = 1, 20, []
    while True:
        g = (lo + hi) // 2
        messages, reward, done = env.step(f"My guess is [{g}].")
        steps.append(g)
        if done:
            return steps, reward
        hint = messages[0]["content"]
        lo, hi = (g + 1, hi) if "higher" in hint else (lo, g - 1)


def test_guess_the_number_is_seeded_by_the_row():
    env = TextArenaEnv("GuessTheNumber-v0")
    env.reset({"question": "q", "seed": 7})
    steps, reward = guess(env)
    assert reward == 1.0 and len(steps) <= 5
    again = TextArenaEnv("GuessTheNumber-v0")
    again.reset({"question": "q", "seed": 7})
    assert guess(again) == (steps, 1.0)  # the same row: the same game (a GRPO group plays one game)
    numbers = set()
    for s in range(8):
        e = TextArenaEnv("GuessTheNumber-v0")
        e.reset({"seed": s})
        numbers.add(guess(e)[0][-1])
    assert len(numbers) > 2  # different rows: different games
    assert row_seed({"question": "a"}) == row_seed({"question": "a"}) != row_seed({"question": "b"})
    assert seeds(3, start=5) == [{"question": f"textarena game, seed {s}", "seed": s} for s in (5, 6, 7)]


def test_episodes_keep_their_own_random_draws():
    """2048 draws a new tile every move: an episode played beside others, and beside code drawing from `random`,
    sees the tiles it sees alone."""
    moves = ["[w]", "[a]", "[s]", "[d]"] * 3

    def transcript(seed, disturb):
        env = TextArenaEnv("2048-v0")
        out = [env.reset({"seed": seed})[0]["content"]]
        for m in moves:
            disturb()
            messages, _, done = env.step(m)
            out.append(messages[0]["content"] if messages else "")
            if done:
                break
        return out

    alone = transcript(1, lambda: None)
    other = TextArenaEnv("2048-v0")
    other.reset({"seed": 2})
    results = []
    thread = threading.Thread(target=lambda: results.append(transcript(1, lambda: other.step("[w]"))))
    thread.start()
    while thread.is_alive():
        random.random()
    thread.join()
    assert results == [alone]


def test_multi_player_games_are_refused():
    with pytest.raises(ValueError, match="MarketEntryGame-v0 is a FFAMultiPlayerState game"):
        TextArenaEnv("MarketEntryGame-v0").reset({"seed": 0})


def test_a_textarena_game_trains_through_the_loop(tiny_run, tmp_path):
    env_kwargs = {"game": "GuessTheNumber-v0", "game_kwargs": {"max_turns": 3}}
    cfg = tiny_run(**{"agent.kind": "env", "data.train.source": "relayrl.envs.textarena:seeds",
                      "data.train.kwargs": json.dumps({"n": 4}), "data.train.answer_key": "null",
                      "agent.kwargs": json.dumps({"env": "relayrl.envs.textarena:TextArenaEnv",
                                                  "env_kwargs": env_kwargs, "max_turns": 3, "reward": "last"}),
                      "run.steps": 1})
    train(cfg)
    steps = [r for r in read_jsonl(tmp_path / "t" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1] and steps[0]["rollout/failed"] == 0
    logged = [rec for f in (tmp_path / "t" / "trajectories").glob("*/monitor.jsonl") for rec in read_jsonl(f)]
    trained = [rec for rec in logged if rec["status"] == "archived"]
    assert trained and all(1 <= rec["turns"] <= 3 for rec in trained)
    assert all("You are playing Guess The Number" in rec["prompt"] for rec in trained)  # reset's opening
    text = "".join(seg["text"] for rec in trained for seg in rec["segments"])
    assert re.search(r"\[GAME\] ", text)  # the game's answers between the turns
