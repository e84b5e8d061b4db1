"""Every numeric config key is finite and in range, errors name the key before any compute, and the CLI
prints input errors (config, datasets, judge.kwargs) without a traceback and leaves no run folder."""

import dataclasses
import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from conftest import write_sums

from relayrl.cli import main
from relayrl.config import ConfigError
from relayrl.config.loader import _schema
from relayrl.config.schema import Config, load_run_config

REPO = Path(__file__).resolve().parents[2]

# keys where any finite number is meaningful
UNBOUNDED = {"run.seed", "data.train.seed", "algo.reward_bias", "judge.reward_weights"}  # a negative weight: a penalty
BASE = ["data.train.source=rows.jsonl"]  # the one required key: checked before the keys of later sections


def numeric_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, type]]:
    """Every int/float key of the schema (lists and tuples of numbers included), with its number type."""
    out = []
    for name, (_, tp) in _schema(cls).items():
        key = f"{prefix}{name}"
        args = [a for a in (tp, *typing.get_args(tp)) if a is not type(None)]
        nested = [a for a in args if isinstance(a, type) and dataclasses.is_dataclass(a)]
        if nested:
            out += numeric_keys(nested[0], key + ".")
            continue
        for a in args:
            inner = typing.get_args(a) if typing.get_origin(a) in (list, tuple) else (a,)
            number = next((t for t in inner if t in (int, float)), None)
            if number is not None:
                out.append((key, number))
                break
    return out


KEYS = [(k, t) for k, t in numeric_keys() if not k.startswith("data.eval.")]  # data.eval is null by default


def test_the_walk_finds_the_keys_it_should():
    found = dict(KEYS)
    assert found["eval.n"] is int and found["train.betas"] is float and found["sampling.stop_token_ids"] is int
    assert found["judge.memory_mb"] is int and found["agent.timeout"] is float and len(found) > 70


@pytest.mark.parametrize("key, number", [(k, t) for k, t in KEYS if k not in UNBOUNDED], ids=lambda v: str(v))
def test_an_absurd_value_is_refused_naming_its_key(key, number):
    value = -(10**9) if number is int else -1e9
    composite = key in ("train.betas", "sampling.stop_token_ids")
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')}: "):
        load_run_config(None, [*BASE, f"{key}={[value, value] if composite else value}"])


@pytest.mark.parametrize("key", [k for k, t in KEYS if t is float and k not in ("train.betas", "judge.reward_weights")])
def test_nan_and_inf_are_refused_for_every_float_key(key):
    for bad in (".nan", ".inf", "-.inf"):
        with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')}: must be a finite number"):
            load_run_config(None, [*BASE, f"{key}={bad}"])
    for lst in ("train.betas", "judge.reward_weights"):  # lists of floats: each item is checked
        with pytest.raises(ConfigError, match=rf"{lst.replace('.', '[.]')}.*finite"):
            load_run_config(None, [*BASE, f"{lst}=[0.9, .nan]"])


@pytest.mark.parametrize("override, message", [
    ("eval.n=0", "eval.n: must be >= 1, got 0"),
    ("eval.size=0", "eval.size: must be >= 1"),
    ("train.betas=[0.9, 1.5]", "train.betas: must be in [0, 1), got 1.5"),
    ("algo.clip_low=1.0", "algo.clip_low: must be in [0, 1)"),
    ("algo.gamma=1.5", "algo.gamma: must be in [0, 1]"),
    ("agent.timeout=0", "agent.timeout: must be > 0"),
    ("judge.memory_mb=16", "judge.memory_mb: must be >= 256"),
])
def test_range_errors_by_hand(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_run_config(None, [*BASE, override])


def test_bf16_optimizer_moments_are_refused_with_fsdp():
    with pytest.raises(ConfigError, match="^train.optimizer_state_dtype: bfloat16 moments need train.engine=local"):
        load_run_config(None, [*BASE, "train.engine=fsdp", "train.optimizer_state_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="^train.optimizer_state_dtype: "):
        load_run_config(None, [*BASE, "train.optimizer_state_dtype=float16"])


def test_async_defaults_to_decoupled_ppo_and_refuses_plain_ppo_off_policy():
    assert load_run_config(None, [*BASE, "scheduler.mode=async"]).algo.decoupled is True
    assert load_run_config(None, [*BASE, "scheduler.mode=async", "scheduler.max_staleness=0"]).algo.decoupled is False
    assert load_run_config(None, BASE).algo.decoupled is False  # sync: on-policy
    with pytest.raises(ConfigError, match="algo.decoupled: scheduler.mode=async with max_staleness=2 trains"):
        load_run_config(None, [*BASE, "scheduler.mode=async", "scheduler.max_staleness=2", "algo.decoupled=false"])


def test_reinforce_pp_baseline_whitens_with_the_batch_mean():
    a = load_run_config(None, [*BASE, "algo.preset=reinforce_pp_baseline"]).algo
    assert (a.adv_mean, a.adv_std) == ("group_batch", "batch")


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = main(["train", *argv])
    return code, capsys.readouterr().err


def test_cli_prints_input_errors_without_a_traceback_and_leaves_no_folder(tiny_path, tmp_path, capsys):
    data = write_sums(tmp_path / "d.jsonl", 4)
    base = [f"model.path={tiny_path}", f"data.train.source={data}", f"run.output_dir={tmp_path / 'runs'}"]
    cases = [  # (extra args, what stderr says)
        (["eval.n=0"], "config error: eval.n: must be >= 1, got 0"),
        (["train.lr=.nan"], "config error: train.lr: must be a finite number, got nan"),
        (["judge.kwargs={format_bonsu: 0.1}"], "config error: judge.kwargs.format_bonsu: unknown argument for "
                                               "reward function math_reward; its keyword arguments are answer_key, "
                                               "format_bonus"),
        (["judge.reward_fn=agents_for_tests:no_such_fn"], "error: judge.reward_fn: module "
                                                          "'agents_for_tests' has no attribute 'no_such_fn'"),
        (["agent.kind=no_such_module:Agent"], "error: agent.kind: cannot import module 'no_such_module'"),
        (["agent.kind=reflection", "agent.kwargs={max_turn: 3}"], "config error: agent.kwargs.max_turn: unknown "
                                                                   "option for agent ReflectionAgent; its options are "
                                                                   "max_turns"),
        (["agent.kind=reflection", "agent.kwargs={plant_first_answer: 2}"], "agent.kwargs.plant_first_answer must "
                                                                            "be in [0, 1], got 2"),
        (["agent.kind=reflection", "eval.agent_kwargs={max_turn: 3}"], "config error: eval.agent_kwargs.max_turn: "
                                                                        "unknown option for agent ReflectionAgent"),
        (["agent.kind=reflection", "eval.agent_kwargs={plant_first_answer: 2}"],  # a bad value only in the eval's
         "eval.agent_kwargs.plant_first_answer must be in [0, 1], got 2"),
    ]
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"question": "a", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    cases.append(([f"data.train.source={latin}"], f"error: {latin}: line 2, column 18: not UTF-8 text (byte 0xe9)"))
    broken = tmp_path / "broken.json"
    broken.write_text('[{"question": "a", "answer": "1"},\n {"question": "b" "answer": "2"}]')
    cases.append(([f"data.train.source={broken}"], f"error: {broken}:2: invalid JSON: Expecting ',' delimiter"))
    for extra, message in cases:
        code, err = run_cli(capsys, *base, *extra)
        assert code == 2 and message in err and "Traceback" not in err, (extra, err)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_bytes(b"train:\n  lr: 1e-5\nrun:\n  name: caf\xe9\n")
    code, err = run_cli(capsys, f"--config={yaml_file}")
    assert code == 2 and f"config error: {yaml_file}: line 4, column 12: not UTF-8 text" in err
    yaml_file.write_text("train:\n  lr: [1e-5\n")
    code, err = run_cli(capsys, f"--config={yaml_file}")
    assert code == 2 and f"config error: {yaml_file}: invalid YAML: line 3, column 1:" in err
    assert not (tmp_path / "runs").exists()  # every case failed before a run folder was made


def test_config_keys_are_still_finite_by_default():
    """The defaults themselves pass (a rule too strict for a default would refuse every run)."""
    cfg = load_run_config(None, BASE)
    assert all(math.isfinite(v) for k, _ in KEYS
               for v in _values(cfg, k) if v is not None)


def _values(cfg, key):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj if isinstance(obj, list | tuple) else [obj]


def test_checking_the_readme_config_imports_neither_torch_nor_transformers():
    """A launcher checks the config before it starts the processes that load models (torchrun for
    train.engine=fsdp, Ray's driver): the check, model alias included, must not pay seconds of torch imports."""
    overrides = ["train.engine=fsdp", "train.optimizer_state_dtype=float32"]
    code = ("import sys; from relayrl.config.schema import load_run_config; "
            f"load_run_config('examples/arithmetic_grpo.yaml', {overrides!r}); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
