"""The start-up report and the refusal to start name the other pagednb engines of the process: in a
notebook, re-running `llm = LLM(...)` builds the new engine while the old one still holds its memory,
and the user must learn that it is there and that close() gives it back (the GPU variant, where the
weights were mislabelled, is in test_gpu_engine.py)."""
import gc
import logging

import pytest

from pagednb import LLM
from pagednb.engine import live_engines
from pagednb.engine.live_engines import format_bytes


@pytest.fixture(scope="module")
def first_model(tiny_model_dir):
    """A model folder no other test uses, so its name in a report can only come from this module's engines."""
    return tiny_model_dir("llama", rms_norm_eps=1.5e-6)


def held_bytes(llm) -> int:
    """What the engine holds, counted here on its tensors."""
    runner = llm.engine.runner
    return sum(p.nbytes for p in runner.model.parameters()) + sum(t.nbytes for t in runner.kv_caches)


def test_a_second_engine_names_the_first_and_close_makes_the_registry_forget_it(first_model, caplog):
    first = LLM(str(first_model), num_kv_blocks=64, device="cpu")
    try:
        memory = live_engines.memory_of(first.engine)
        assert memory is not None and memory.device == "cpu" and memory.model == first_model.name
        assert memory.total_bytes == held_bytes(first)
        with caplog.at_level(logging.INFO, logger="pagednb"):
            second = LLM(num_kv_blocks=64, device="cpu")
        with second:
            report = caplog.text
            assert live_engines.memory_of(second.engine) is not None
    finally:
        first.close()
    assert "other pagednb engines in this process hold" in report and "close()" in report
    assert f"{first_model.name}: {format_bytes(memory.total_bytes)}" in report
    assert live_engines.memory_of(first.engine) is None and live_engines.memory_of(second.engine) is None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagednb"):
        third = LLM(num_kv_blocks=64, device="cpu")
    with third:
        assert first_model.name not in caplog.text  # closed: no longer reported


def test_refusing_to_start_tells_to_close_the_other_engines(first_model):
    with LLM(str(first_model), num_kv_blocks=64, device="cpu"):
        with pytest.raises(ValueError) as refused:
            LLM(kv_cache_memory=1024, max_model_len=512, device="cpu")  # no whole block; one request needs 32
    message = str(refused.value)
    assert "max_model_len=512 needs 32 blocks" in message
    assert f"{first_model.name}: " in message and "close()" in message


def test_a_dropped_engine_leaves_the_registry():
    llm = LLM(num_kv_blocks=64, device="cpu")
    engine = llm.engine
    assert live_engines.memory_of(engine) is not None
    del llm  # LLM.__del__ closes it, as re-running `llm = LLM(...)` does with the old one
    gc.collect()
    assert live_engines.memory_of(engine) is None


def test_the_registry_holds_engines_weakly():
    class Engine:
        pass
    engine = Engine()
    live_engines.register(engine, "/models/Qwen3-0.6B/", "cpu", 3 * 2**30, 2**29)
    assert live_engines.memory_of(engine).model == "Qwen3-0.6B"
    assert "Qwen3-0.6B: 3.50 GiB" in live_engines.describe(live_engines.on_device("cpu"))
    del engine
    gc.collect()
    assert "Qwen3-0.6B" not in live_engines.describe(live_engines.on_device("cpu"))
