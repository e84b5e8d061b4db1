"""Agents: how a trajectory is produced. Built-in kinds are named in `AGENTS`; any other kind is an
import path ('package.module:AgentClass')."""

from relayrl.agents.base import Agent
from relayrl.agents.env import EnvAgent
from relayrl.agents.external import ExternalAgent
from relayrl.agents.openai_agent import OpenAIAgent, session_of
from relayrl.agents.reflection import ReflectionAgent
from relayrl.agents.single_turn import SingleTurnAgent
from relayrl.agents.tool import ToolAgent
from relayrl.agents.verifiers import VerifiersAgent

AGENTS: dict[str, type[Agent]] = {"single_turn": SingleTurnAgent, "reflection": ReflectionAgent, "tool": ToolAgent,
                                  "openai": OpenAIAgent, "env": EnvAgent, "external": ExternalAgent,
                                  "verifiers": VerifiersAgent}

__all__ = ["AGENTS", "Agent", "EnvAgent", "ExternalAgent", "OpenAIAgent", "ReflectionAgent", "SingleTurnAgent",
           "ToolAgent", "VerifiersAgent", "session_of"]
