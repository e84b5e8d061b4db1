"""The dataset side: prompt sources, prompt building and the DataManager."""

from relayrl.data.datasets import PromptBuilder, find_gsm8k, load_rows
from relayrl.data.formats import prompt_messages
from relayrl.data.manager import DataManager

__all__ = ["DataManager", "PromptBuilder", "find_gsm8k", "load_rows", "prompt_messages"]
