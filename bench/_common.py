"""Shared helpers for the bench scripts: the result header (date, commit, machine, command) and atomic JSON writes.

Importing it puts this checkout first on sys.path (and on PYTHONPATH, for the subprocesses a bench starts): a
script run as `python bench/x.py` would otherwise import whichever relayrl is installed (an editable install of
another checkout, say) and measure that code under this checkout's commit.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

from relayrl.common.files import atomic_write_text  # noqa: E402 - after the path above

# Run a command as on an AVX2-only CPU: restricts ATen's and oneDNN's kernels (not MKL's sgemm, not vLLM's own).
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def git_commit() -> str:
    """Short sha of HEAD, with '-dirty' when tracked files differ from it ('unknown' outside git)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def machine_info() -> dict:
    """CPU model, torch's CPU capability, the bf16 flags and ISA switches in force, cores, GPU: the context every
    recorded number needs (an AVX2-only CPU runs bf16 ~65x slower than one with AVX512-BF16/AMX)."""
    import torch

    from relayrl.common.hardware import bf16_support, cpu_info

    info = cpu_info()
    info["native_bf16"] = bf16_support("cpu").native
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


def result_header(name: str) -> dict:
    return {"name": name, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "commit": git_commit(), "machine": machine_info(), "command": shlex.join([sys.executable, *sys.argv])}


def dispatch(doc: str, commands: dict[str, Callable[[list[str]], object]]) -> None:
    """Run the sub-command that sys.argv[1] names with the arguments after it; without one, or with --help, list the
    sub-commands. A script groups the benches of one component so they share their code; each sub-command keeps
    the options, JSON keys and default result file of the script it was."""
    script, argv = Path(sys.argv[0]).name, sys.argv[1:]
    if argv and argv[0] in commands:
        commands[argv[0]](argv[1:])
        return
    if argv and argv[0] not in ("-h", "--help"):
        sys.exit(f"error: {script}: no command {argv[0]!r}; the commands: {', '.join(commands)} (--help lists them)")
    width = max(map(len, commands))
    print(f"usage: {script} COMMAND [options]    ({script} COMMAND --help: that command's options)\n\n"
          f"{inspect.cleandoc(doc).split(chr(10) * 2)[0]}\n\ncommands:")
    for name, fn in commands.items():
        summary = " ".join(inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0].split())
        print(f"  {name:<{width}}  {textwrap.shorten(summary, 116 - width, placeholder=' ...')}")
    if not argv:
        sys.exit(f"error: {script} needs a command, one of {', '.join(commands)}")


def parser(command: str, doc: str | None) -> argparse.ArgumentParser:
    """A sub-command's parser: its usage names the script and the sub-command, its description is the first
    paragraph of the sub-command's docstring."""
    return argparse.ArgumentParser(prog=f"{Path(sys.argv[0]).name} {command}",
                                   description=inspect.cleandoc(doc or "").split("\n\n")[0])


def kernel_builds(current, build, baseline_source: str | None) -> dict:
    """{"kernel": this checkout's library (`current`), "baseline": `build(source)` of another version of its file}
    for a kernel bench; exits with a message when one is missing (no C compiler, or kernels switched off)."""
    libs = {"kernel": current}
    if baseline_source:
        libs["baseline"] = build(Path(baseline_source), fallback="no baseline")
    if any(lib is None for lib in libs.values()):
        sys.exit("error: a kernel did not build or kernels are switched off (RELAYRL_KERNELS)")
    return libs


def write_json(path: str | os.PathLike, obj: dict) -> None:
    """Write obj as indented JSON atomically (temp file in the same folder, then os.replace)."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def synchronize(device) -> None:
    """Wait for the device's queued work, so a GPU timing covers the kernels and not only their launch."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def load_before_run() -> float:
    """The 1-minute load average now, with a warning when another process is using the CPU (the run's
    timings would not be representative); benches record it in their result."""
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"WARNING: 1-min load average is {load:.2f} before the run: another process is using the CPU, "
              "so step times are not representative", file=sys.stderr)
    return load


def std_err(p: float, n: int) -> float:
    """Binomial standard error of a pass rate p measured on n samples."""
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def curve_point(step: int, samples: int, wall_s: float, metrics: dict[str, float]) -> dict:
    """One point of a time-to-accuracy curve from a relayrl eval's metrics (eval/pass@1, eval/samples, time/eval_s):
    the same record for every side of bench/time_to_accuracy.py."""
    p = metrics["eval/pass@1"]
    return {"step": step, "samples": samples, "wall_s_excl_eval": wall_s, "pass@1": p,
            "stderr": std_err(p, int(metrics["eval/samples"])), "eval_s": metrics.get("time/eval_s", 0.0)}


def run_child(script: str, args: list[str], what: str, env: dict[str, str] | None = None) -> dict:
    """Run `script args --result-file F` in a fresh interpreter and return the dict it wrote to F. A paired bench
    runs each side this way so that every side has its own heap and high-water mark; the child's stdout goes to
    our stderr (our stdout is the result), and a failed child stops the bench naming `what`."""
    with tempfile.TemporaryDirectory(prefix="bench_child_") as d:
        out = os.path.join(d, "result.json")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore",
               **(env or {})}
        proc = subprocess.run([sys.executable, os.path.abspath(script), *args, "--result-file", out], env=env,
                              cwd=REPO, stdout=sys.stderr)
        if proc.returncode:
            raise SystemExit(f"{what} failed with exit code {proc.returncode}")
        return json.loads(Path(out).read_text())


def proc_rss(pid: int | str) -> int:
    """VmRSS of a process in bytes (0 when it has gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS")), 0)


def descendants(pid: int) -> list[str]:
    out, todo = [], [str(pid)]
    while todo:
        for f in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = f.read_text().split()
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def train_run(config: str, overrides: list[str], out_dir: str, env: dict[str, str]) -> dict:
    """One `relayrl train` in a subprocess, as a user runs it: its output, wall time, run folder, and the RSS of the
    trainer, of its child processes (judge workers) and of both together, sampled every 50 ms (a peak shorter than
    that can be missed: the trainer's own high-water mark is in its metrics). A failed run stops the bench."""
    cmd = [str(Path(sys.executable).with_name("relayrl")), "train", "--config", config,
           f"run.output_dir={out_dir}", *overrides]
    peaks = {"trainer": 0, "workers": 0, "tree": 0}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def watch() -> None:
        while proc.poll() is None:
            trainer, workers = proc_rss(proc.pid), sum(proc_rss(pid) for pid in descendants(proc.pid))
            peaks.update(trainer=max(peaks["trainer"], trainer), workers=max(peaks["workers"], workers),
                         tree=max(peaks["tree"], trainer + workers))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    output = proc.communicate()[0]
    watcher.join()
    wall = time.perf_counter() - t0
    sys.stderr.write(output[-4000:])
    if proc.returncode:
        raise SystemExit(f"relayrl train {' '.join(overrides)} failed with exit code {proc.returncode}")
    (run_dir,) = Path(out_dir).iterdir()
    return {"command": cmd, "output": output, "wall_s": wall, "peaks": peaks, "run_dir": run_dir}


def rss_bytes() -> int:
    """This process's resident set, read from /proc (cheap enough to sample every few milliseconds)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PhaseSampler:
    """Samples RSS on a thread and keeps the peak per phase (the phase is whatever `phase` was last set to)."""

    def __init__(self, interval: float = 0.005):
        self.phase, self.peaks, self.interval = "startup", {}, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = rss_bytes()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            time.sleep(self.interval)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {k: round(v / 1e9, 3) for k, v in self.peaks.items()}
