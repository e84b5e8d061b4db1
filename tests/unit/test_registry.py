"""`Registry`, the extension points' shared type: a registered name, an import path, a clear error for neither,
and one binding per name; and the registries the config names (agents, rewards, estimators, losses)."""

import pytest

from relayrl.agents import AGENTS, SingleTurnAgent
from relayrl.common.errors import InputError
from relayrl.common.registry import Registry, is_import_path
from relayrl.judge import REWARDS, math_reward, reward_fn_path, reward_function
from relayrl.trainer.estimators import ESTIMATORS
from relayrl.trainer.losses import LOSSES


def double(x: int) -> int:
    return 2 * x


def test_a_registered_name_and_an_import_path_resolve():
    reg: Registry = Registry("widget")
    assert reg.register("double")(double) is double  # the decorator hands the object back unchanged
    assert reg.get("double", "x.widget") is double and "double" in reg and reg.names() == ["double"]
    assert reg.get(f"{__name__}:double", "x.widget") is double  # a user's own, by import path
    assert reg.get(f"{__name__}.double", "x.widget") is double


def test_an_unknown_name_is_one_line_naming_the_key_and_the_choices():
    reg: Registry = Registry("widget")
    reg.register("b")(double)
    reg.register("a")(len)
    with pytest.raises(InputError) as e:
        reg.get("c", "x.widget")
    assert str(e.value) == ("x.widget: unknown widget 'c'; built-in: a, b, or 'package.module:name' for your own")
    with pytest.raises(InputError, match=r"^x\.widget: cannot import module 'no_such_module'"):
        reg.get("no_such_module:thing", "x.widget")
    with pytest.raises(InputError, match=r"^x\.widget: module 'math' has no attribute 'nope'"):
        reg.get("math:nope", "x.widget")


def test_a_name_is_bound_once():
    reg: Registry = Registry("widget")
    reg.register("double")(double)
    reg.register("double")(double)  # the same object again (a module imported twice) is no conflict
    with pytest.raises(ValueError, match="widget 'double' is registered twice"):
        reg.register("double")(len)
    with pytest.raises(ValueError, match="would read as an import path"):
        reg.register("my.widget")
    assert is_import_path("a.b:c") and is_import_path("pickle:/x.pkl") and not is_import_path("grpo")


def test_the_built_in_extension_points():
    assert AGENTS.get("single_turn", "agent.kind") is SingleTurnAgent
    assert {"single_turn", "reflection", "tool", "env"} <= set(AGENTS.names())
    assert ESTIMATORS.names() == ["gae", "return"] and LOSSES.names() == ["ppo_clip"]
    assert REWARDS.get("math", "judge.reward_fn") is math_reward
    assert {"llm_judge", "reward_model"} <= set(REWARDS.names())


def test_a_reward_name_travels_to_the_workers_as_its_import_path():
    assert reward_fn_path("math") == "relayrl.judge.math:math_reward"  # what a judge worker imports
    assert reward_fn_path("relayrl.judge.math:math_reward") == "relayrl.judge.math:math_reward"
    assert reward_function("math") is math_reward
    with pytest.raises(InputError, match=r"^judge\.reward_fn\[1\]: unknown reward function 'maths'; built-in: "):
        reward_function("maths", "judge.reward_fn[1]")
    with pytest.raises(InputError, match=r"^judge\.reward_fn: 'relayrl.judge:DEFAULT_REWARD' is a str, not a fun"):
        reward_function("relayrl.judge:DEFAULT_REWARD")
