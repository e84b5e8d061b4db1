"""POST /update_weights_from_disk: load a safetensors folder as new weights, only from under --weights-root.

Reading any folder a client names would let a client probe the server's filesystem (the errors tell which
paths exist) and load whatever it finds. So the route is off unless the server was started with
`--weights-root DIR` (403 with a message saying so), and a folder is loaded only when its real path -- `..`
and symlinks resolved -- lies under the root's real path; so must each *.safetensors file in it, since a file
can itself be a symlink out of the root. Relative paths are taken from the server's working folder, as
before (a launched server shares the trainer's).

Names and shapes are read from the files' headers and checked against the served model before any tensor is
loaded, so a wrong or oversized checkpoint is refused whole, costs no memory, and never leaves the engine
half-updated. Once loaded, every tensor is checked again (`check_tensors`: a known name, the served shape, a
floating dtype for a floating parameter, every value finite) before any of it reaches the engine: one NaN
would make every later forward NaN, and the old weights must keep serving.

LoRA adapters (`M.lora_A`, `M.lora_B`, `M.lora_scaling`: relayrl.trainer.lora's wire format) are accepted for any
linear layer M of the served model, checked the same way (shapes against M.weight, every layer whole), and merged
into a copy of the base weights as a local engine merges them. The server needs no LoRA setting: rank and scaling
travel in the tensors themselves. A load failure answers SGLang's
`{"success": false, "message"}` with 400; the message names the folder and the file, never a library's
exception text (that goes to the server log).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from relayrl.serve.errors import ApiError, BadRequest
from relayrl.serve.limits import INT64, number
from relayrl.trainer.lora import adapter_set_error, adapter_shape_error, is_adapter_name

log = logging.getLogger("relayrl.serve")
_NUMERIC = re.compile(r"^\d{1,18}$")


def weight_version(body: dict[str, Any], current: int) -> int:
    """`weight_version` as an int >= 0 (a numeric string too, as SGLang clients send it); default current + 1."""
    value = body.get("weight_version")
    if value is None:
        return current + 1
    if isinstance(value, str):
        if not _NUMERIC.match(value.strip()):
            raise BadRequest("weight_version", "must be an integer >= 0")
        return int(value)
    return number(body, "weight_version", None, int, low=0, high=INT64[1])


def resolve_under_root(root: Path | None, raw: Any) -> Path:
    """The real path of the folder `raw`, which must lie under the real path of `root`."""
    if root is None:
        raise ApiError(403, "model_path", "loading weights from disk is disabled on this server (start it with "
                       "--weights-root DIR to allow folders under DIR)", "weights_from_disk_disabled")
    if not isinstance(raw, str) or not raw:
        raise BadRequest("model_path", "missing (a folder of *.safetensors files)")
    if "\x00" in raw:
        raise BadRequest("model_path", "must not contain a NUL character")
    real_root, real = Path(os.path.realpath(root)), Path(os.path.realpath(raw))
    if not real.is_relative_to(real_root):
        raise ApiError(403, "model_path", f"{raw[:300]!r} is outside this server's weights root (--weights-root; "
                       "'..' and symlinks are resolved before the check)", "outside_weights_root")
    return real


def _headers(files: list[Path], root: Path, shown: str) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape) from the safetensors headers, each file's real path checked against the root."""
    real_root, found = Path(os.path.realpath(root)), {}
    for f in files:
        real = Path(os.path.realpath(f))
        if not real.is_relative_to(real_root):
            raise ApiError(403, "model_path", f"{f.name} in {shown} links outside this server's weights root",
                           "outside_weights_root")
        try:
            with safe_open(str(real), framework="pt") as h:
                shapes = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}  # noqa: SIM118 (not a dict)
        except Exception as e:  # the client learns which file, the log also why
            log.warning("update_weights_from_disk: cannot read %s: %s: %s", real, type(e).__name__, e)
            raise BadRequest("model_path", f"{f.name} in {shown} is not a readable safetensors file") from None
        for name, shape in shapes.items():
            if name in found:
                raise BadRequest("model_path", f"{name!r} is in both {found[name][0].name} and {f.name}")
            found[name] = (real, shape)
    return found


def load_checked(model_state: dict[str, Any], root: Path, folder: Path, shown: str) -> dict[str, Any]:
    """Check every file's names and shapes against the served model, then load them."""
    if not folder.is_dir():
        raise BadRequest("model_path", f"{shown} is not a directory")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise BadRequest("model_path", f"no .safetensors files in {shown}")
    headers = _headers(files, root, shown)
    for name, (f, shape) in headers.items():
        if is_adapter_name(name):
            if bad := adapter_shape_error(name, shape, model_state):
                raise BadRequest("model_path", f"{f.name}: {name}: {bad}")
        elif name not in model_state:
            raise BadRequest("model_path", f"{f.name}: the served model has no parameter {name!r}")
        elif shape != tuple(model_state[name].shape):
            raise BadRequest("model_path", f"{f.name}: {name} has shape {list(shape)}, the served model "
                             f"{list(model_state[name].shape)}")
    if bad := adapter_set_error({name: shape for name, (_, shape) in headers.items()}):
        raise BadRequest("model_path", f"{shown}: {bad}")
    tensors: dict[str, Any] = {}
    for f in sorted({f for f, _ in headers.values()}):
        try:
            loaded = load_file(str(f))
        except Exception as e:
            log.warning("update_weights_from_disk: cannot load %s: %s: %s", f, type(e).__name__, e)
            raise BadRequest("model_path", f"{f.name} in {shown} could not be loaded") from None
        check_tensors(loaded.items(), model_state, "model_path", where=f"{f.name}: ")
        tensors.update(loaded)
    return tensors


def check_tensors(named: Iterable[tuple[str, torch.Tensor]], served: dict[str, torch.Tensor], field: str,
                  where: str = "") -> None:
    """BadRequest naming the first tensor that is not a served parameter, has another shape, a dtype that cannot
    hold it (an integer or bool tensor for a floating parameter), or a value that is NaN or infinite. `where`:
    the tensors' source (a file) for the message; without it the field is indexed (`names[3]`)."""
    for i, (name, tensor) in enumerate(named):
        bad = _tensor_error(name, tensor, served)
        if bad:
            raise BadRequest(field if where else f"{field}[{i}]", f"{where}{name}: {bad}")


def _tensor_error(name: str, tensor: torch.Tensor, served: dict[str, torch.Tensor]) -> str | None:
    if is_adapter_name(name):  # a LoRA adapter's part, merged into its layer (relayrl.trainer.lora)
        if bad := adapter_shape_error(name, tuple(tensor.shape), served):
            return bad
        if not tensor.is_floating_point():
            return f"dtype {str(tensor.dtype)[6:]}: an adapter is floating point"
    else:
        target = served.get(name)
        if target is None:
            return "the served model has no such parameter"
        if tuple(tensor.shape) != tuple(target.shape):
            return f"shape {list(tensor.shape)}, the served model {list(target.shape)}"
        if target.is_floating_point() != tensor.is_floating_point():
            return f"dtype {str(tensor.dtype)[6:]}, the served model {str(target.dtype)[6:]}"
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        return "holds NaN or infinite values; the served weights are kept"
    return None


async def update_from_disk(body: dict[str, Any], state: Any) -> tuple[int, dict[str, Any]]:
    """The route's work: (status, SGLang answer). Path and version are checked before anything is aborted."""
    folder = resolve_under_root(state.weights_root, body.get("model_path"))
    shown = body["model_path"][:300]
    version = weight_version(body, state.engine.version)
    if body.get("abort_all_requests"):
        await state.abort()
    try:
        model_state = state.engine.model.state_dict()
        tensors = await asyncio.to_thread(load_checked, model_state, state.weights_root, folder, shown)
        await asyncio.to_thread(state.engine.load_weights, tensors.items(), version)
    except BadRequest as e:
        return 400, {"success": False, "message": str(e), "weight_version": state.engine.version}
    return 200, {"success": True, "message": f"loaded {len(tensors)} tensors from {shown}", "weight_version": version}
