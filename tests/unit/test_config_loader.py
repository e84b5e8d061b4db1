"""relayrl.config.loader: YAML + dotted overrides -> validated dataclasses; errors name the key and file."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
import yaml

from relayrl.config import (
    ConfigError,
    apply_overrides,
    check,
    dump_yaml,
    fill_missing,
    from_dict,
    load_config,
    to_dict,
)


@dataclass
class OptimConfig:
    betas: tuple[float, ...] = (0.9, 0.999)
    weight_decay: float = 0.0


@dataclass
class TrainConfig:
    algo: Literal["grpo", "ppo"] = "grpo"
    lr: float = 1e-6
    batch_size: int = 8
    micro_batch_size: int = 4
    max_steps: int | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss_weights: dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        check(self.batch_size >= 1, "batch_size", "must be >= 1")
        check(self.batch_size % self.micro_batch_size == 0, "micro_batch_size",
              f"must divide batch_size ({self.batch_size})")


@dataclass
class EvalConfig:
    datasets: list[str]
    every_steps: int = 100

    def validate(self) -> None:
        if self.every_steps <= 0:
            raise ValueError("every_steps must be positive")


@dataclass
class Config:
    model: str = field(metadata={"help": "HF id or local path"})
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig | None = None
    tags: list[str] = field(default_factory=list)
    generation: dict[str, Any] = field(default_factory=dict)
    preset: str | None = None
    seed: int = 0

    def validate(self) -> None:
        steps, ev = self.train.max_steps, self.eval
        check(steps is None or ev is None or ev.every_steps <= steps, "eval.every_steps",
              "must not exceed train.max_steps")


PRESETS = {"small": {"train": {"batch_size": 16, "micro_batch_size": 4, "lr": 3e-4}, "seed": 7}}


def expand_presets(data: dict[str, Any]) -> dict[str, Any]:
    """The schema-side hook: fill preset values only where the user wrote nothing."""
    name = data.get("preset")
    if name is None:
        return data
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return fill_missing(data, PRESETS[name])


def write(tmp_path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return str(info.value)


BASE_YAML = """\
model: gpt2
train:
  lr: 1e-5          # PyYAML alone would read this as the string '1e-5'
  batch_size: 16
  optim:
    betas: [0.8, 0.9]
    weight_decay: 0   # an int for a float field
  loss_weights: {kl: 1}
eval:
  datasets: [gsm8k]
generation: {temperature: 0.7, stop: ["\\n"], nested: {anything: true}}
"""


def test_yaml_load_builds_typed_nested_config(tmp_path):
    cfg = load_config(Config, write(tmp_path, BASE_YAML))
    assert cfg.model == "gpt2"
    assert cfg.train.lr == 1e-5 and isinstance(cfg.train.lr, float)
    assert cfg.train.optim.betas == (0.8, 0.9)
    assert cfg.train.optim.weight_decay == 0.0 and isinstance(cfg.train.optim.weight_decay, float)
    assert cfg.train.loss_weights == {"kl": 1.0} and isinstance(cfg.train.loss_weights["kl"], float)
    assert cfg.train.algo == "grpo" and cfg.train.max_steps is None  # defaults
    assert cfg.eval == EvalConfig(datasets=["gsm8k"], every_steps=100)
    assert cfg.generation == {"temperature": 0.7, "stop": ["\n"], "nested": {"anything": True}}


def test_empty_yaml_file_is_an_empty_config(tmp_path):
    cfg = load_config(Config, write(tmp_path, "# nothing\n"), ["model=m"])
    assert cfg == Config(model="m")


@pytest.mark.parametrize(("text", "expected"), [
    ("1e-5", 1e-5), ("3E+2", 300.0), ("-1.5e-3", -1.5e-3), (".5e1", 5.0), ("1.0e-3", 1e-3),
    ("7", 7), ("0.25", 0.25), ("null", None), ("", None), ("[1, 2]", [1, 2]), ("abc", "abc"),
    ("'1e-5'", "1e-5"), ("{a: 1}", {"a": 1}), ("a=b", "a=b"), ("true", True),
])
def test_override_values_are_yaml_with_scientific_floats(text, expected):
    value = apply_overrides({}, [f"x={text}"])["x"]
    assert value == expected and type(value) is type(expected)


def test_overrides_set_nested_keys_create_missing_ones_and_do_not_mutate_input():
    data = {"train": {"lr": 0.1, "optim": {"betas": [0.9, 0.99]}}, "eval": None}
    out = apply_overrides(data, ["train.optim.weight_decay=0.01", "eval.datasets=[a, b]", "new.deep.key=1",
                                 "train.lr=2e-5", "train.lr=3e-5"])
    assert out == {"train": {"lr": 3e-5, "optim": {"betas": [0.9, 0.99], "weight_decay": 0.01}},
                   "eval": {"datasets": ["a", "b"]}, "new": {"deep": {"key": 1}}}
    assert data == {"train": {"lr": 0.1, "optim": {"betas": [0.9, 0.99]}}, "eval": None}


def test_overrides_through_load_config(tmp_path):
    path = write(tmp_path, BASE_YAML)
    cfg = load_config(Config, path, ["train.lr=2e-6", "train.max_steps=1000", "eval=null", "tags=[a, b]",
                                     "train.optim.betas=[0.5, 0.6]", "generation.top_p=0.9"])
    assert cfg.train.lr == 2e-6 and cfg.train.max_steps == 1000 and cfg.eval is None
    assert cfg.tags == ["a", "b"] and cfg.train.optim.betas == (0.5, 0.6)
    assert cfg.generation["top_p"] == 0.9 and cfg.generation["temperature"] == 0.7
    assert load_config(Config, None, ["model=m", "train.max_steps=1e3"]).train.max_steps == 1000


@pytest.mark.parametrize("bad", ["noequals", "=5", " =5", "a..b=1", ".a=1", "a.=1", "a. b=1"])
def test_malformed_override_is_named(bad):
    assert repr(bad) in error_of(apply_overrides, {}, [bad])


def test_override_through_a_non_mapping_and_bad_yaml_value():
    msg = error_of(apply_overrides, {"model": "gpt2"}, ["model.name=x"])
    assert msg.startswith("model: cannot set 'model.name=x'") and "str 'gpt2'" in msg
    assert "override 'tags=[a, b'" in error_of(apply_overrides, {}, ["tags=[a, b"])
    with pytest.raises(TypeError):
        apply_overrides({}, "model=x")


def test_unknown_top_level_key_suggests_close_match(tmp_path):
    path = write(tmp_path, "model: m\ntrian:\n  lr: 0.1\n")
    assert error_of(load_config, Config, path) == f"{path}: trian: unknown key; did you mean train?"


def test_unknown_nested_key_suggests_dotted_close_match(tmp_path):
    path = write(tmp_path, "model: m\ntrain:\n  lrr: 0.1\n")
    assert error_of(load_config, Config, path) == f"{path}: train.lrr: unknown key; did you mean train.lr?"


def test_unknown_key_without_close_match_lists_all_valid_keys_at_that_level():
    msg = error_of(from_dict, Config, {"model": "m", "train": {"optim": {"zzz": 1}}})
    assert msg == "train.optim.zzz: unknown key; valid keys here: train.optim.betas, train.optim.weight_decay"


def test_unknown_key_from_override_names_the_override(tmp_path):
    path = write(tmp_path, "model: m\n")
    msg = error_of(load_config, Config, path, ["trian.lr=1e-5"])
    assert msg == f"{path}: trian: unknown key; did you mean train? (see override 'trian.lr=1e-5')"
    msg = error_of(load_config, Config, path, ["train.lrr=1e-5"])
    assert msg.startswith(f"{path}: train.lrr: unknown key; did you mean train.lr?")


@pytest.mark.parametrize(("override", "expected"), [
    ("train.lr=abc", "train.lr: expected float, got str 'abc'"),
    ("train.lr=true", "train.lr: expected float, got bool True"),
    ("train.batch_size=true", "train.batch_size: expected int, got bool True"),
    ("train.batch_size=2.5", "train.batch_size: expected int, got float 2.5"),
    ("train.max_steps=many", "train.max_steps: expected int, got str 'many'"),
    ("model=5", "model: expected str, got int 5"),
    ("tags=x", "tags: expected list[str], got str 'x'"),
    ("tags=[a, 1]", "tags[1]: expected str, got int 1"),
    ("train.optim.betas=[0.9, x]", "train.optim.betas[1]: expected float, got str 'x'"),
    ("train.loss_weights.kl=abc", "train.loss_weights.kl: expected float, got str 'abc'"),
    ("generation=[1]", "generation: expected dict[str, Any], got list [1]"),
    ("train=5", "train: expected a mapping (TrainConfig), got int 5"),
])
def test_wrong_types_name_key_expected_type_and_value(override, expected):
    msg = error_of(load_config, Config, None, ["model=m", override])
    assert msg.startswith(expected), msg


def test_numeric_strings_are_accepted_for_number_fields_only(tmp_path):
    path = write(tmp_path, "model: m\ntrain:\n  lr: '1e-5'\n  batch_size: '32'\n  max_steps: '1e3'\n")
    cfg = load_config(Config, path)
    assert (cfg.train.lr, cfg.train.batch_size, cfg.train.max_steps) == (1e-5, 32, 1000)
    assert type(cfg.train.batch_size) is int and type(cfg.train.max_steps) is int
    assert "expected str, got float 1.5" in error_of(from_dict, Config, {"model": 1.5})


def test_union_prefers_exact_type_before_converting_numeric_strings():
    @dataclass
    class U:
        x: int | str = 0

    assert from_dict(U, {"x": "5"}).x == "5"
    assert from_dict(U, {"x": 5}).x == 5
    assert "x: expected int | str, got list [1]" in error_of(from_dict, U, {"x": [1]})


def test_literal_violation_lists_options(tmp_path):
    path = write(tmp_path, "model: m\ntrain: {algo: ppoo}\n")
    assert error_of(load_config, Config, path) == (
        f"{path}: train.algo: expected one of 'grpo', 'ppo', got str 'ppoo'; did you mean 'ppo'?")
    assert "got bool True" in error_of(from_dict, Config, {"model": "m", "train": {"algo": True}})


def test_missing_required_key(tmp_path):
    path = write(tmp_path, "train: {lr: 0.1}\n")
    assert error_of(load_config, Config, path) == f"{path}: model: missing required key"
    msg = error_of(from_dict, Config, {"model": "m", "eval": {"every_steps": 5}})
    assert msg == "eval.datasets: missing required key"


def test_validate_failures_carry_dotted_path_and_file(tmp_path):
    path = write(tmp_path, "model: m\ntrain: {batch_size: 0}\n")
    assert error_of(load_config, Config, path) == f"{path}: train.batch_size: must be >= 1"
    msg = error_of(load_config, Config, path, ["train.batch_size=6"])
    assert msg == f"{path}: train.micro_batch_size: must divide batch_size (6)"
    msg = error_of(load_config, Config, path, ["train.batch_size=6", "train.micro_batch_size=5"])
    assert msg.endswith("must divide batch_size (6) (see override 'train.micro_batch_size=5')")
    # a plain ValueError from validate() is reported at the sub-config's path
    assert error_of(from_dict, Config, {"model": "m", "eval": {"datasets": [], "every_steps": 0}}) == (
        "eval: every_steps must be positive")
    # top-level cross-field check names the full key
    data = {"model": "m", "train": {"max_steps": 5}, "eval": {"datasets": []}}
    assert error_of(from_dict, Config, data) == "eval.every_steps: must not exceed train.max_steps"


def test_validation_is_post_order_children_first():
    data = {"model": "m", "train": {"batch_size": 0, "max_steps": 5}, "eval": {"datasets": []}}
    assert error_of(from_dict, Config, data) == "train.batch_size: must be >= 1"


def test_from_dict_prefix_and_source_appear_in_messages():
    msg = error_of(from_dict, TrainConfig, {"batch_size": 0}, source="run.yaml", prefix="stages[0]")
    assert msg == "run.yaml: stages[0].batch_size: must be >= 1"
    assert from_dict(TrainConfig, {"lr": 1}).lr == 1.0


def test_preset_hook_explicit_values_win(tmp_path):
    path = write(tmp_path, "model: m\npreset: small\ntrain:\n  micro_batch_size: 8\n")
    cfg = load_config(Config, path, ["train.batch_size=32"], presets_hook=expand_presets)
    assert cfg.train.batch_size == 32  # the override beats the preset's 16
    assert cfg.train.micro_batch_size == 8  # the file beats the preset's 4
    assert cfg.train.lr == 3e-4 and cfg.seed == 7  # unset keys come from the preset
    cfg = load_config(Config, path, ["preset=null"], presets_hook=expand_presets)
    assert cfg.train.lr == 1e-6 and cfg.seed == 0
    # a preset value still goes through validation (16 is not divisible by 5)
    msg = error_of(load_config, Config, path, ["train.micro_batch_size=5"], presets_hook=expand_presets)
    assert msg.startswith(f"{path}: train.micro_batch_size: must divide batch_size (16)")


def test_preset_hook_error_names_file(tmp_path):
    path = write(tmp_path, "model: m\npreset: huge\n")
    msg = error_of(load_config, Config, path, presets_hook=expand_presets)
    assert msg == f"{path}: preset: unknown preset 'huge'; known: small"


def test_fill_missing_keeps_explicit_values_including_null():
    data = {"a": None, "b": {"x": 1}}
    out = fill_missing(data, {"a": 5, "b": {"x": 2, "y": 3}, "c": [1]})
    assert out == {"a": None, "b": {"x": 1, "y": 3}, "c": [1]}
    assert data == {"a": None, "b": {"x": 1}}


def test_to_dict_from_dict_round_trip(tmp_path):
    cfg = load_config(Config, write(tmp_path, BASE_YAML), ["train.max_steps=200", "tags=[x]"])
    plain = to_dict(cfg)
    assert plain["train"]["optim"]["betas"] == [0.8, 0.9]  # tuples become lists
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain  # plain data only
    assert from_dict(Config, plain) == cfg
    assert from_dict(Config, {"model": "m", "train": cfg.train}).train == cfg.train  # instances are accepted


def test_dump_yaml_is_atomic_and_loads_back(tmp_path):
    cfg = load_config(Config, write(tmp_path, BASE_YAML, "in.yaml"), ["train.lr=1e-7"])
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    target = out_dir / "config.yaml"
    target.write_text("old: content\n")
    dump_yaml(cfg, str(target))
    assert os.listdir(out_dir) == ["config.yaml"]  # replaced in place, no temp file left behind
    assert yaml.safe_load(target.read_text()) == to_dict(cfg)
    assert load_config(Config, str(target)) == cfg  # 1e-07 dumped by PyYAML as 1.0e-07 reads back as a float


def test_dump_yaml_failure_leaves_old_file_and_no_temp_files(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_text("old: content\n")
    with pytest.raises(yaml.YAMLError):
        dump_yaml({"bad": object()}, str(target))
    assert os.listdir(tmp_path) == ["config.yaml"] and target.read_text() == "old: content\n"


def test_missing_file_names_the_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    assert error_of(load_config, Config, path) == f"{path}: config file not found"


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_yaml_names_the_file(tmp_path, text):
    path = write(tmp_path, text)
    assert error_of(load_config, Config, path).startswith(f"{path}: the top level must be a mapping")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "model: m\ntrain:\n  lr: [1, 2\n  batch_size: 3\n")
    msg = error_of(load_config, Config, path)
    assert msg.startswith(f"{path}: invalid YAML:") and "line 4" in msg


def test_duplicate_yaml_key_is_an_error_but_merge_keys_work(tmp_path):
    path = write(tmp_path, "model: m\ntrain:\n  lr: 0.1\n  lr: 0.2\n")
    msg = error_of(load_config, Config, path)
    assert msg.startswith(f"{path}: invalid YAML:") and "duplicate key 'lr'" in msg and "line 4" in msg
    path = write(tmp_path, "model: m\ngeneration: {base: &b {lr: 0.1, batch_size: 4}}\n"
                           "train:\n  <<: *b\n  lr: 0.2\n", "anchors.yaml")
    cfg = load_config(Config, path)
    assert (cfg.train.lr, cfg.train.batch_size) == (0.2, 4)


def test_describe_lists_every_dotted_key_with_type_and_default():
    from relayrl.config.docs import describe

    text = describe(Config)
    lines = text.splitlines()
    assert lines[:2] == ["model: str (required)", "    HF id or local path"]
    assert "train:" in lines
    assert "train.algo: Literal['grpo', 'ppo'] = 'grpo'" in lines
    assert "train.lr: float = 1e-06" in lines
    assert "train.max_steps: int | None = None" in lines
    assert "train.optim.betas: tuple[float, ...] = (0.9, 0.999)" in lines
    assert "train.loss_weights: dict[str, float] = {}" in lines
    assert "eval: EvalConfig | None = None" in lines  # an optional section shows its None default
    assert "eval.datasets: list[str] (required)" in lines
    assert "generation: dict[str, Any] = {}" in lines
