"""Where a training run's processes start, chosen in one place: on Ray (launcher=ray: every process an actor,
trainer ranks included, relayrl.run.ray_launch), as torchrun's trainer ranks on this machine (train.engine=fsdp
outside a torchrun: this same command once per rank, each of which comes back here with RANK set), or in this
process (relayrl.run.loop.train, which is also what each Ray actor and torchrun rank runs)."""

from __future__ import annotations

import os
import subprocess
import sys

from relayrl.common.errors import Terminated
from relayrl.config.schema import Config
from relayrl.run.loop import train
from relayrl.run.ray_launch import train_on_ray


def launch(cfg: Config, argv: list[str]) -> int:
    """Train `cfg`, started as its config asks; the exit code. `argv` is the command's arguments after
    `relayrl` (train, config, overrides): what torchrun runs once per rank. The final eval is printed where
    the loop ran (under torchrun, by rank 0)."""
    if cfg.launcher == "ray":
        final = train_on_ray(cfg)
    elif cfg.train.engine == "fsdp" and "RANK" not in os.environ:
        return _torchrun(cfg.train.world_size, argv)
    else:
        final = train(cfg)
    if final:
        print("final eval: " + ", ".join(f"{k}={v:.4f}" for k, v in final.items() if "pass" in k or "reward" in k))
    return 0


def _torchrun(world_size: int, argv: list[str]) -> int:
    """Run this same command as `world_size` trainer processes on this machine (torchrun --standalone);
    under a torchrun of the user's own (RANK is set: several machines), relayrl does not start one."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           "-m", "relayrl.cli", *argv]
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except Terminated:  # only this process got it: torchrun forwards SIGTERM to its ranks
        proc.terminate()
        proc.wait()
        raise
    except KeyboardInterrupt:  # torchrun got the same Ctrl-C (the terminal's process group) and stops its ranks
        proc.wait()
        return 130
