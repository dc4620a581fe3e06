"""vLLM code runs unchanged where pagednb has the feature, and gets a clear answer where it has not:
CompletionOutput.finished() is a method (RequestOutput.finished an attribute), llm.llm_engine is the
engine, llm.get_metrics() lists named counters and gauges equal to stats(), vLLM-only LLM options
are refused naming the option unless their value asks for nothing (then ignored), unknown options
still get the TypeError listing pagednb's own."""
from __future__ import annotations

import pytest

from pagednb import LLM, SamplingParams
from pagednb.metrics import Counter, Gauge
from pagednb.outputs import CompletionOutput
from pagednb.vllm_compat import IGNORED_WHEN


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def llm(model):
    engine = LLM(model, num_kv_blocks=32, max_model_len=128)
    yield engine
    engine.close()


def test_completion_finished_is_a_method_and_request_finished_an_attribute(llm):
    assert callable(CompletionOutput.finished)
    out = llm.generate("The cat", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.finished is True  # an attribute, as vLLM's RequestOutput
    assert out.outputs[0].finished() is True
    running = CompletionOutput(index=0, text="", token_ids=[])
    assert running.finished() is False


def test_llm_engine_is_the_engine(llm):
    assert llm.llm_engine is llm.engine
    rid = llm.llm_engine.add_request(None, "step api", SamplingParams(max_tokens=2))
    finals = []
    while llm.llm_engine.has_unfinished_requests():
        finals += [o for o in llm.llm_engine.step() if o.finished]
    assert [o.request_id for o in finals] == [rid]


def test_get_metrics_lists_counters_and_gauges_from_stats(llm):
    llm.generate(["a", "b"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    stats = llm.stats()
    metrics = llm.get_metrics()
    by_name = {m.name: m for m in metrics}
    assert len(by_name) == len(metrics)
    for key, value in stats.items():
        assert by_name[f"pagednb:{key}"].value == value
    assert isinstance(by_name["pagednb:generated_tokens"], Counter)
    assert isinstance(by_name["pagednb:running"], Gauge)
    assert by_name["pagednb:generated_tokens"].value >= 8
    assert all(m.labels == {"model_name": llm.engine.config.model} for m in metrics)


@pytest.mark.parametrize("name, value", [
    ("quantization", "awq"), ("swap_space", 8), ("cpu_offload_gb", 4), ("distributed_executor_backend", "ray"),
    ("pipeline_parallel_size", 2), ("calculate_kv_scales", True),
    ("enable_lora", True), ("max_loras", 4), ("enable_chunked_prefill", False), ("data_parallel_size", 2),
    ("logprobs_mode", "processed_logprobs"), ("logprobs_mode", "raw_logits"), ("logprobs_mode", "processed_logits"),
])
def test_vllm_only_options_are_refused_naming_them(model, name, value):
    with pytest.raises(ValueError, match=rf"pagednb does not support {name}=.*\(a vLLM option\)"):
        LLM(model, num_kv_blocks=8, **{name: value})


def test_harmless_vllm_options_are_accepted_and_ignored(model):
    harmless = dict(distributed_executor_backend="mp", pipeline_parallel_size=1, disable_log_stats=True,
                    swap_space=4, quantization=None, enable_lora=False,
                    enable_chunked_prefill=True, cpu_offload_gb=0, logprobs_mode="raw_logprobs")
    with LLM(model, num_kv_blocks=8, max_model_len=64, **harmless) as llm:
        assert llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    assert all(name in IGNORED_WHEN for name in harmless)


def test_unknown_options_keep_the_type_error_listing_pagednb_options(model):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_num_seq'.*max_num_seqs"):
        LLM(model, max_num_seq=4)


def test_logprobs_mode_names_the_one_mode_pagednb_returns(model):
    """vLLM's default mode (raw logprobs) is what pagednb computes; the processed ones are refused by name."""
    with pytest.raises(ValueError, match=r"logprobs_mode='processed_logprobs'.*only logprobs_mode='raw_logprobs'"):
        LLM(model, num_kv_blocks=8, logprobs_mode="processed_logprobs")


def test_a_failed_request_does_not_cost_the_batch_its_outputs(llm):
    """vLLM's generate returns every output; pagednb raises the first failed request's error, but only once
    the batch ran to the end: the error names every failed request and carries all outputs, in order."""
    tokenizer = llm.engine.tokenizer
    word, token = next((w, t) for t in range(3, llm.engine.spec.vocab_size) for w in [tokenizer.decode([t]).strip()]
                       if w and tokenizer.encode(w, add_special_tokens=False) == [t])
    nothing_left = SamplingParams(max_tokens=3, allowed_token_ids=[token], bad_words=[word])  # no token to sample
    fine = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(Exception) as caught:
        llm.generate(["a", "b", "c", "d"], [fine, nothing_left, fine, nothing_left], use_tqdm=False)
    outputs = caught.value.outputs
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length", "error"]
    assert caught.value is outputs[1].error
    assert [len(o.outputs[0].token_ids) for o in outputs[::2]] == [4, 4]
    assert any(f"{outputs[1].request_id}:" in note and f"{outputs[3].request_id}:" in note and "2 of 4" in note
               for note in caught.value.__notes__)
