"""Agents: how a trajectory is produced. agent.kind is a built-in kind registered in `AGENTS` (each agent's module
registers it; importing it here is what runs the registration: not every module of the package is imported, since
the episode proxy needs the serve extra), or an import path ('package.module:AgentClass')."""

from relayrl.agents.base import AGENTS, Agent
from relayrl.agents.env import EnvAgent
from relayrl.agents.external import ExternalAgent
from relayrl.agents.openai_agent import OpenAIAgent, session_of
from relayrl.agents.reflection import ReflectionAgent
from relayrl.agents.single_turn import SingleTurnAgent
from relayrl.agents.tool import ToolAgent
from relayrl.agents.verifiers import VerifiersAgent

__all__ = ["AGENTS", "Agent", "EnvAgent", "ExternalAgent", "OpenAIAgent", "ReflectionAgent", "SingleTurnAgent",
           "ToolAgent", "VerifiersAgent", "session_of"]
