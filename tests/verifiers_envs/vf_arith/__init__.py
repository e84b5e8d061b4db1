"""A tiny verifiers (0.4, `verifiers.v1`) taskset for relayrl's tests: one-turn arithmetic, scored by a
`@vf.reward` method on the task; no download, no network. relayrl's rows become its tasks; its own `load()`
tasks are what `verifiers_runner.py --tasks` prints."""

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: str = ""


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(2, 2), (3, 4), (5, 1)]:
            yield ArithTask(ArithData(prompt=f"What is {a}+{b}?", answer=str(a + b)), self.config.task)


__all__ = ["ArithTaskset"]
