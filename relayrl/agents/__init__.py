"""Agents: how a trajectory is produced. Built-in kinds are named in `AGENTS`; any other kind is an
import path ('package.module:AgentClass')."""

from relayrl.agents.base import Agent
from relayrl.agents.single_turn import SingleTurnAgent

AGENTS: dict[str, type[Agent]] = {"single_turn": SingleTurnAgent}

__all__ = ["AGENTS", "Agent", "SingleTurnAgent"]
