"""Datasets, prompt building and the DataManager, on real files and the real tokenizer of the tiny model."""

import json
from pathlib import Path

import pytest

from relayrl.config.schema import DatasetConfig, PromptConfig
from relayrl.data import DataManager, PromptBuilder, find_gsm8k, load_rows
from relayrl.models import load_tokenizer
from relayrl.sample import Status

FIXTURES = Path(__file__).parents[1] / "fixtures"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_rows_are_normalised(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"q": "1+1?", "a": 2, "extra": "x"}, {"q": "2+2?", "a": 4}])
    rows = load_rows(DatasetConfig(source=src, prompt_key="q", answer_key="a"))
    assert rows[0]["question"] == "1+1?" and rows[0]["answer"] == "2" and rows[0]["extra"] == "x"
    assert len(load_rows(DatasetConfig(source=src, prompt_key="q", answer_key="a", size=1))) == 1


@pytest.mark.parametrize("content, message", [
    ('{"question": "a", "answer": "1"}\n{"question": "b"}\n', r"d.jsonl:2: row has no 'answer'"),
    ('{"question": "a", "answer": "1"}\nnot json\n', r"d.jsonl:2: invalid JSON"),
    ('["a", "b"]\n', r"d.jsonl:1: row is a list"),
    ("", "has no rows"),
])
def test_bad_files_name_the_line(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        load_rows(DatasetConfig(source=str(tmp_path / "d.jsonl")))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(DatasetConfig(source=str(tmp_path / "nope.jsonl")))


def test_json_list_file(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps([{"question": "a", "answer": "1"}]))
    assert load_rows(DatasetConfig(source=str(tmp_path / "d.json")))[0]["answer"] == "1"


def test_gsm8k_by_name_from_env_folder(monkeypatch):
    monkeypatch.setenv("RELAYRL_GSM8K_DIR", str(FIXTURES / "gsm8k"))
    rows = load_rows(DatasetConfig(source="gsm8k:train"))
    assert len(rows) == 5 and rows[0]["answer"].endswith("#### 72")
    assert find_gsm8k("test").parent == FIXTURES / "gsm8k"


def test_gsm8k_missing_split_lists_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAYRL_GSM8K_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="RELAYRL_GSM8K_DIR"):
        find_gsm8k("validation")


def test_reasoning_gym_task_by_name():
    kw = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
          "allow_parentheses": False, "allow_negation": False}
    rows = load_rows(DatasetConfig(source="reasoning_gym:basic_arithmetic", size=5, seed=3, kwargs=kw))
    again = load_rows(DatasetConfig(source="reasoning_gym:basic_arithmetic", size=5, seed=3, kwargs=kw))
    assert len(rows) == 5 and rows == again
    assert all("+" in r["question"] and r["answer"].lstrip("-").isdigit() for r in rows)
    with pytest.raises(ValueError, match="reasoning_gym task 'no_such_task'"):
        load_rows(DatasetConfig(source="reasoning_gym:no_such_task", size=2))


def make_rows(n=3):
    return [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(n)]


def test_function_source(tmp_path, monkeypatch):
    (tmp_path / "my_rows.py").write_text("def rows(n):\n    return [{'question': str(i), 'answer': str(i)}"
                                         " for i in range(n)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert len(load_rows(DatasetConfig(source="my_rows:rows", kwargs={"n": 4}))) == 4


def test_prompt_builder_uses_chat_template(tiny_path):
    tok = load_tokenizer(tiny_path)
    pb = PromptBuilder(tok, PromptConfig(system="Be brief.", suffix=" Answer:"))
    text = pb.text({"question": "What is 2+2?"})
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2? Answer:<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.decode(pb({"question": "What is 2+2?"})) == text
    raw = PromptBuilder(tok, PromptConfig(chat_template=False, suffix=""))
    assert tok.decode(raw({"question": "7*6"})) == "7*6"


def test_data_manager_groups_epochs_and_resume(tiny_path):
    tok = load_tokenizer(tiny_path)
    dm = DataManager(make_rows(3), PromptBuilder(tok, PromptConfig()), group_size=4, shuffle=True, seed=7)
    group = dm.sample_from_dataset()
    assert len(group) == 4 and len({s.group_id for s in group}) == 1 and [s.index for s in group] == [0, 1, 2, 3]
    assert all(s.prompt_ids == group[0].prompt_ids and s.prompt_ids is not group[0].prompt_ids for s in group[1:])
    state = dm.state_dict()
    after = [dm.sample_from_dataset()[0].data["question"] for _ in range(5)]  # crosses an epoch boundary
    assert dm.epoch == 1 and sorted(after[:2] + [group[0].data["question"]]) == sorted(r["question"]
                                                                                       for r in make_rows(3))
    dm2 = DataManager(make_rows(3), PromptBuilder(tok, PromptConfig()), group_size=4, shuffle=True, seed=7)
    dm2.load_state_dict(state)
    assert [dm2.sample_from_dataset()[0].data["question"] for _ in range(5)] == after


def test_replay_buffer_hands_out_completed_samples_once(tiny_path):
    dm = DataManager(make_rows(2), PromptBuilder(load_tokenizer(tiny_path), PromptConfig()), group_size=2)
    group = dm.sample_from_dataset()
    group[0].status = Status.COMPLETED
    dm.add_to_replay_buffer(group)
    batch = dm.get_batch()
    assert batch == [group[0]] and batch[0].status == Status.ARCHIVED
    assert dm.get_batch() == [] and len(dm.replay_buffer) == 0  # the unfinished sample never entered


def test_replay_buffer_waits_for_groups_and_reports_producer_failure(tiny_path):
    import threading

    dm = DataManager(make_rows(4), PromptBuilder(load_tokenizer(tiny_path), PromptConfig()), group_size=1)
    groups = [dm.sample_from_dataset() for _ in range(3)]
    for g in groups:
        g[0].status = Status.COMPLETED

    def produce():
        for g in groups:
            dm.add_to_replay_buffer(g)

    threading.Timer(0.2, produce).start()
    assert [s.uid for s in dm.get_batch(3, timeout=5)] == [g[0].uid for g in groups]  # FIFO
    with pytest.raises(TimeoutError):
        dm.get_batch(1, timeout=0.1)
    dm.replay_buffer.fail(ValueError("agent exploded"))
    with pytest.raises(RuntimeError, match="producer failed") as info:
        dm.get_batch(1)
    assert isinstance(info.value.__cause__, ValueError)
    dm.requeue({"question": "again?", "answer": "1"})
    assert dm.sample_from_dataset()[0].data["question"] == "again?"
