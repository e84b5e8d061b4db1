"""A verifiers taskset whose reward function raises: its episodes must fail, not train on a reward of 0."""

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        raise ValueError("the answer key is missing")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        yield BrokenTask(vf.TaskData(prompt="What is 2+2?"), self.config.task)


__all__ = ["BrokenTaskset"]
