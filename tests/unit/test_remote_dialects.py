"""Remote dialects as registered classes (relayrl.engine.dialects): engine.backend resolves a name or an import path,
the start-up check says what does not fit engine.launch / engine.weight_sync with one rule, and a dialect that
lacks a capability gets the base class's answer, with no server asked. A user dialect driving a real relayrl serve:
tests/integration/test_remote.py."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.common.errors import InputError
from relayrl.engine.base import NotSupported, SamplingParams
from relayrl.engine.dialects import (
    DISTRIBUTED_RULE,
    REMOTE_BACKENDS,
    Dialect,
    Reply,
    SGLangDialect,
    VLLMDialect,
    dialect_class,
)
from relayrl.engine.remote import RemoteEngine

UNREACHABLE = "http://127.0.0.1:9"


class Bare(Dialect):
    """The least a dialect implements: every optional capability is the base class's."""

    async def generate(self, input_ids, params, rid, images, version) -> Reply:
        return Reply([7, 8], [-0.5, -0.25], [version, version], "length", "bare-1")

    async def load_from_disk(self, path: str, version: int) -> None:
        raise AssertionError("not called here")

    async def pause(self) -> None:
        return

    async def resume(self) -> None:
        return

    async def flush_cache(self) -> None:
        return


class Broadcasting(SGLangDialect):
    """A user's dialect inherits what its parent speaks: launchers, distributed weight sync."""


class NotADialect:
    pass


def test_names_and_import_paths_resolve_and_bad_ones_name_the_key():
    assert REMOTE_BACKENDS.names() == ["sglang", "vllm"]
    assert dialect_class("sglang") is SGLangDialect and dialect_class("vllm") is VLLMDialect
    assert dialect_class(f"{__name__}:Bare") is Bare
    with pytest.raises(InputError, match=r"engine.backend: unknown remote backend 'tgi'; built-in: sglang, vllm"):
        dialect_class("tgi")
    with pytest.raises(InputError, match="engine.backend: .*NotADialect' is not a relayrl.engine.dialects.Dialect"):
        dialect_class(f"{__name__}:NotADialect")
    with pytest.raises(InputError, match="engine.backend"):
        RemoteEngine(UNREACHABLE, backend="no_such_module_xyz:Thing")


def test_launch_and_distributed_rules_read_the_dialects_flags():
    # (the config accepts any name: it cannot import the engine; from_config runs this check, test_remote.py)
    with pytest.raises(InputError, match=r"engine.backend: 'sglang' does not speak .*launch=vllm.*backend=vllm"):
        dialect_class("sglang", launch="vllm")
    with pytest.raises(InputError, match=r"engine.launch=relayrl.*set engine.backend=sglang"):
        dialect_class("vllm", launch="relayrl")
    assert dialect_class(f"{__name__}:Broadcasting", launch="relayrl", weight_sync="distributed") is Broadcasting
    for backend in ("vllm", f"{__name__}:Bare"):
        with pytest.raises(InputError) as info:
            dialect_class(backend, weight_sync="distributed")
        assert str(info.value) == DISTRIBUTED_RULE
    with pytest.raises(InputError, match="engine.weight_sync=distributed needs backend=sglang"):
        RemoteEngine(UNREACHABLE, backend="vllm", weight_sync="distributed")


def test_a_dialect_without_a_capability_gets_the_base_answer_without_a_request():
    engine = RemoteEngine(UNREACHABLE, backend=f"{__name__}:Bare", retries=0)
    try:
        assert isinstance(engine.dialect, Bare) and engine.dialect.server is engine
        out = asyncio.run(engine.agenerate([1, 2, 3], SamplingParams(max_new_tokens=2)))
        assert out.output_ids == [7, 8] and out.finish_reason == "length" and out.meta["id"] == "bare-1"
        assert engine.abort() == 0 and engine.num_running() == -1
        assert engine.refresh_version() == 0  # the server keeps no version: the engine's own count stands
        with pytest.raises(ValueError, match="cannot go to a Bare server"):
            asyncio.run(engine.agenerate([1], SamplingParams(max_new_tokens=2), images=(b"png",)))
        with pytest.raises(NotSupported, match="Bare does not load LoRA adapters by name"):
            asyncio.run(engine.dialect.load_adapter("/nowhere", 1))
        assert engine.stats["requests"] == 1 and engine.stats["retries"] == 0
    finally:
        engine.close()


def test_a_reply_without_one_logprob_per_token_is_refused():
    class Short(Bare):
        async def generate(self, input_ids, params, rid, images, version) -> Reply:
            return Reply([7, 8], [-0.5], [0, 0], "stop", None)

    engine = RemoteEngine(UNREACHABLE, backend="vllm", retries=0)
    engine.dialect = Short(engine)
    try:
        with pytest.raises(RuntimeError, match="returned 1 logprobs for 2 tokens"):
            asyncio.run(engine.agenerate([1, 2], SamplingParams(max_new_tokens=2)))
    finally:
        engine.close()
