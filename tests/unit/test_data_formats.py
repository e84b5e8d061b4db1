"""Data in the formats users have (TRL's standard and conversational rows), per-dataset system prompts, and the
answer-format suffix only for the shipped tasks: real files in tmp_path, the tiny model's real tokenizer."""

import json

import pytest
from conftest import tiny_run_args

from relayrl.agents.tool import ToolAgent
from relayrl.cli import main
from relayrl.common.errors import InputError
from relayrl.common.files import read_jsonl
from relayrl.config.schema import DatasetConfig, PromptConfig, load_run_config
from relayrl.data import DataManager, PromptBuilder, load_rows
from relayrl.data.datasets import BOXED_SUFFIX
from relayrl.data.formats import prompt_messages
from relayrl.models import load_tokenizer
from relayrl.run.build import build
from relayrl.run.loop import train_steps

SYSTEM = {"role": "system", "content": "You are terse."}
ASK = {"role": "user", "content": "What is 2+2?"}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat(tok, messages) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_trl_standard_rows_keep_every_column_and_get_no_hidden_suffix(tmp_path, tiny_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 2+2?", "solution": "4", "level": 3}])
    row = load_rows(DatasetConfig(source=src, answer_key="solution"))[0]
    assert row == {"prompt": "What is 2+2?", "solution": "4", "level": 3, "question": "What is 2+2?", "answer": "4"}
    tok = load_tokenizer(tiny_path)
    built = PromptBuilder(tok, PromptConfig(), DatasetConfig(source=src)).text(row)
    assert built == chat(tok, [ASK]) and "boxed" not in built


def test_conversational_prompt_is_templated_as_messages(tmp_path, tiny_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [SYSTEM, ASK], "answer": 4, "id": "a"}])
    row = load_rows(DatasetConfig(source=src))[0]
    assert row["question"] == "What is 2+2?" and row["answer"] == "4" and row["id"] == "a"
    assert row["prompt"] == [SYSTEM, ASK] and row["prompt_messages"] == [SYSTEM, ASK]
    tok = load_tokenizer(tiny_path)
    pb = PromptBuilder(tok, PromptConfig(), DatasetConfig(source=src))
    assert pb.text(row) == chat(tok, [SYSTEM, ASK]) and "'role'" not in pb.text(row)  # never a Python repr
    assert tok.decode(pb(row)) == pb.text(row)
    dm = DataManager([row], pb, group_size=2, shuffle=False)
    group = dm.sample_from_dataset()
    assert group[0].data["id"] == "a" and tok.decode(group[1].prompt_ids) == chat(tok, [SYSTEM, ASK])


def test_messages_column_final_assistant_turn_is_the_reference(tmp_path):
    convo = [SYSTEM, ASK, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
             {"role": "assistant", "content": "6"}]
    src = write_jsonl(tmp_path / "d.jsonl", [{"messages": convo}, {"messages": convo[:4], "answer": "6!"},
                                             {"messages": convo[:2]}])
    with pytest.raises(InputError, match=r"d.jsonl:3: row has no 'answer'.*answer_key \(null when"):
        load_rows(DatasetConfig(source=src))
    first, second, third = load_rows(DatasetConfig(source=src, answer_key=None))
    assert first["prompt_messages"] == convo[:4] and first["answer"] == "6" and first["question"] == "And 3+3?"
    assert first["messages"] == convo  # the column itself is passed on untouched
    assert second["prompt_messages"] == convo[:4] and second["answer"] == "6!"  # the answer column wins
    assert third["prompt_messages"] == convo[:2] and "answer" not in third


def test_answer_key_null_allows_rows_without_an_answer(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Say hi", "target_len": 5}])
    with pytest.raises(InputError, match=r"d.jsonl:1: row has no 'answer'"):
        load_rows(DatasetConfig(source=src))
    assert load_rows(DatasetConfig(source=src, answer_key=None)) == [
        {"prompt": "Say hi", "target_len": 5, "question": "Say hi"}]


@pytest.mark.parametrize("prompt, message", [
    ([ASK, "hi"], r"d.jsonl:2: data.train field 'prompt', message 1 is a str"),
    ([{"role": "bot", "content": "x"}], r"d.jsonl:2: data.train field 'prompt', message 0: role 'bot' is not one"),
    ([{"role": "user", "content": 7}], r"d.jsonl:2: data.train field 'prompt', message 0: content is of type int"),
    ([{"role": "user"}], r"d.jsonl:2: data.train field 'prompt', message 0: content is missing"),
    ([SYSTEM], r"d.jsonl:2: data.train field 'prompt' has no user message"),
    ([ASK, SYSTEM], r"d.jsonl:2: data.train field 'prompt' ends with a system message"),
    ({"text": "x"}, r"d.jsonl:2: data.train field 'prompt' is a dict; a prompt is text or a list of chat messages"),
])
def test_bad_messages_name_file_line_and_field(tmp_path, prompt, message):
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [ASK], "answer": "1"}, {"prompt": prompt, "answer": "1"}])
    with pytest.raises(InputError, match=message):
        load_rows(DatasetConfig(source=src))


def test_prompt_key_names_the_field_and_missing_prompts_are_named(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"conv": [ASK], "prompt": "ignored", "answer": "4"}])
    assert load_rows(DatasetConfig(source=src, prompt_key="conv"))[0]["prompt_messages"] == [ASK]
    with pytest.raises(InputError, match=r"d.jsonl:1: row has no 'task'.*data.eval.prompt_key"):
        load_rows(DatasetConfig(source=src, prompt_key="task"), "data.eval")
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"text": "x", "answer": "1"}])
    with pytest.raises(InputError, match=r"bare.jsonl:1: row has no 'question', 'prompt' or 'messages'"):
        load_rows(DatasetConfig(source=bare))


def test_dataset_system_overrides_the_global_one_and_joins_the_rows_own(tmp_path, tiny_path):
    tok = load_tokenizer(tiny_path)
    src = write_jsonl(tmp_path / "d.jsonl", [{"question": "What is 2+2?", "answer": "4"},
                                             {"prompt": [SYSTEM, ASK], "answer": "4"}])
    text_row, chat_row = load_rows(DatasetConfig(source=src))
    glob = PromptConfig(system="Global.")
    assert PromptBuilder(tok, glob, DatasetConfig(source=src)).messages(text_row)[0]["content"] == "Global."
    mine = PromptBuilder(tok, glob, DatasetConfig(source=src, system="Mine."))
    assert mine.text(text_row) == chat(tok, [{"role": "system", "content": "Mine."}, ASK])
    assert mine.messages(chat_row) == [{"role": "system", "content": "Mine.\n\nYou are terse."}, ASK]
    none = PromptBuilder(tok, glob, DatasetConfig(source=src, system=""))  # "" turns the global one off
    assert none.messages(text_row) == [ASK]


def test_suffix_is_the_sources_own_unless_set(tmp_path, tiny_path):
    tok = load_tokenizer(tiny_path)
    row = {"question": "What is 2+2?", "answer": "4"}
    boxed = [{"role": "user", "content": "What is 2+2?" + BOXED_SUFFIX}]
    for source in ("gsm8k:train", "reasoning_gym:basic_arithmetic"):
        assert PromptBuilder(tok, PromptConfig(), DatasetConfig(source=source)).messages(row) == boxed
    user = DatasetConfig(source=str(tmp_path / "d.jsonl"))
    assert PromptBuilder(tok, PromptConfig(), user).messages(row) == [ASK]
    assert PromptBuilder(tok, PromptConfig(), None).messages(row) == [ASK]
    assert PromptBuilder(tok, PromptConfig(suffix=BOXED_SUFFIX), user).messages(row) == boxed
    assert PromptBuilder(tok, PromptConfig(suffix=""), DatasetConfig(source="gsm8k:train")).messages(row) == [ASK]
    convo = {"prompt_messages": [SYSTEM, ASK, {"role": "tool", "content": "4"}], "question": "What is 2+2?"}
    assert prompt_messages(convo, None, " Answer:")[1] == {"role": "user", "content": "What is 2+2? Answer:"}


def test_readme_job_prompts_keep_the_boxed_instruction(tiny_path):
    cfg = load_run_config("examples/arithmetic_grpo.yaml", [f"model.path={tiny_path}", "data.train.size=3"])
    tok = load_tokenizer(tiny_path)
    for data, key in ((cfg.data.train, "data.train"), (cfg.data.eval, "data.eval")):
        rows = load_rows(data, key, cfg.data.prompt)
        pb = PromptBuilder(tok, cfg.data.prompt, data)
        for row in rows[:3]:  # the text the README job was tuned on: question + boxed instruction as the user turn
            legacy = chat(tok, [{"role": "user", "content": row["question"] + "\nPut your final answer within "
                                                                              "\\boxed{}."}])
            assert "prompt_messages" not in row and tok.decode(pb(row)) == legacy


def test_raw_text_prompts_refuse_chat_messages_before_a_model_loads(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": [ASK], "answer": "1"}])
    with pytest.raises(InputError, match=r"d.jsonl:2: the prompt is a list of chat messages but "
                                         r"data.prompt.chat_template is false"):
        load_rows(DatasetConfig(source=src), "data.train", PromptConfig(chat_template=False))


def test_tool_agent_prompts_with_the_rows_messages(tmp_path, tiny_path):
    tok = load_tokenizer(tiny_path)
    agent = ToolAgent(None, tok, None, None, tools=["calculator"], instruction=" Use tools.")
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [SYSTEM, ASK], "answer": "4"}])
    text = tok.decode(agent.prompt_ids(load_rows(DatasetConfig(source=src))[0]))
    assert "You are terse." in text and "What is 2+2? Use tools." in text and "'role'" not in text
    assert text.count("What is 2+2?") == 1


def test_cli_names_a_bad_message_without_a_traceback(tmp_path, tiny_path, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", [{"messages": [ASK, {"role": "assistant", "content": "4"}]},
                                             {"messages": [{"role": "human", "content": "hi"}]}])
    assert main(["train", *tiny_run_args(tiny_path, src, tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "d.jsonl:2: data.train field 'messages', message 0: role 'human' is not one of" in err
    assert "Traceback" not in err


REWARD = '''
def level_reward(response, data):
    """1 when the reward sees the row's own column and its chat prompt: TRL-style data reaches the reward whole."""
    return float(data["level"] == 3 and data["prompt_messages"][0]["content"] == "You are terse.")
'''


def test_conversational_data_trains_end_to_end(tmp_path, tiny_path, monkeypatch):
    (tmp_path / "level_rewards.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [SYSTEM, {"role": "user", "content": f"Count to {i}."}],
                                              "level": 3} for i in range(4)])
    over = {"run.steps": 1, "judge.reward_fn": "level_rewards:level_reward", "data.train.answer_key": "null",
            "run.log_trajectories": True}
    cfg = load_run_config(None, tiny_run_args(tiny_path, src, tmp_path, **over))
    c = build(cfg)
    try:
        train_steps(c)
    finally:
        c.close()
    step = next(r for r in read_jsonl(c.run_dir / "metrics.jsonl") if "train/loss" in r)
    assert step["rollout/reward_mean"] == 1.0
    recs = [r for f in (c.run_dir / "trajectories").glob("*/monitor.jsonl") for r in read_jsonl(f)]
    assert recs and all("You are terse." in r["prompt"] and "Count to" in r["prompt"] for r in recs)
    assert not any("boxed" in r["prompt"] for r in recs)


def test_parquet_messages_drop_the_nulls_arrow_fills_in(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [ASK, {"role": "assistant", "content": "4"}], "answer": None},  # null: the final turn
            {"messages": [{"role": "user", "content": "Hi", "name": "bob"}], "answer": "hello"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")  # arrow gives row 0's messages name=None
    first, second = load_rows(DatasetConfig(source=str(tmp_path / "d.parquet")))
    assert first["prompt_messages"] == [ASK] and first["answer"] == "4"
    assert second["prompt_messages"] == [{"role": "user", "content": "Hi", "name": "bob"}]
