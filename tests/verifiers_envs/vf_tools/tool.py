"""The taskset's tool server: verifiers launches it per rollout as `python -m vf_tools.tool`."""

import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is advertised as `add`, not `add_toolset_add`

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


if __name__ == "__main__":
    AddToolset.run()
