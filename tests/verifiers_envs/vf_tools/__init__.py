"""A verifiers (0.4, `verifiers.v1`) taskset with a tool: arithmetic where the model may call `add` from an MCP
toolset (`vf.Toolset`, launched per rollout as a local process), played by verifiers' chat-only `null` harness;
the reward counts the tool's use. For relayrl's tool-calling test of `agent.kind: verifiers`."""

import verifiers.v1 as vf

from vf_tools.tool import AddToolset


class ToolData(vf.TaskData):
    answer: str = ""


class ToolTask(vf.Task[ToolData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [AddToolset(vf.ToolsetConfig())]

    @vf.reward
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(m.get("role") == "tool" for m in _dicts(trace.messages)))

    @vf.metric
    async def tool_results(self, trace: vf.Trace) -> float:
        return float(sum(m.get("role") == "tool" for m in _dicts(trace.messages)))


def _dicts(messages):
    return [m if isinstance(m, dict) else m.model_dump() for m in messages]


class ToolTaskset(vf.Taskset[ToolTask, vf.TasksetConfig]):
    def load(self):
        yield ToolTask(ToolData(prompt="What is 2+2? Use the add tool.", answer="4"), self.config.task)


__all__ = ["ToolTaskset"]
