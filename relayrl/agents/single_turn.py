"""`SingleTurnAgent`: one engine call, then the judge (RL from verifiable rewards)."""

from __future__ import annotations

from relayrl.agents.base import AGENTS, Agent
from relayrl.sample import Sample, Status


@AGENTS.register("single_turn")
class SingleTurnAgent(Agent):
    async def generate_sample(self, sample: Sample) -> Sample:
        # no rid: a one-turn trajectory has no next turn to route or to keep its KV cache for
        out = await self.rollout_ctl.generate(sample.prompt_ids, self.params_for(sample), images=tuple(sample.images))
        sample.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason, out.routed_experts)
        sample.response_text = self.decode(out.output_ids)
        if self.judge is not None:
            await self.judge.judge(sample)
        sample.status = Status.COMPLETED
        return sample
