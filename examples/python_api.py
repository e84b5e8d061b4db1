"""Your own agent and reward, trained from Python with no YAML (docs/agents.md, "From Python or a notebook").

    .venv/bin/python examples/python_api.py                  # 5 GRPO steps of SmolLM2 on arithmetic
    .venv/bin/python examples/python_api.py run.steps=20     # any config key=value as an override
"""

import sys

from relayrl import Agent, Status, load_config, train


def reward(response: str, row: dict) -> float:  # 1 when the reference answer appears in the response
    return float(str(row["answer"]) in response)


class OneShot(Agent):  # one generation, then the judge
    async def generate_sample(self, sample):
        out = await self.rollout_ctl.generate(sample.prompt_ids, self.params_for(sample))
        sample.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason)
        sample.response_text = self.decode(out.output_ids)
        await self.judge.judge(sample)
        sample.status = Status.COMPLETED
        return sample


if __name__ == "__main__":
    cfg = load_config(overrides=["data.train.source=reasoning_gym:basic_arithmetic", "data.batch_size=4",
                                 "run.steps=5", "run.name=python_api", *sys.argv[1:]])
    print(train(cfg, agent=OneShot, reward=reward))
