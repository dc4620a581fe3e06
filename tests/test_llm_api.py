"""The public API on a tiny random model: prompt forms, output order, sampling that is reproducible
whatever the batch, stops and finish reasons, streaming through the step API, aborts, chat, stats,
pool sizing, and bad input that raises a clear error while the engine keeps serving."""
import gc

import pytest

from pagednb import LLM, RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("pool_checked_after_each_test")


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, max_model_len=256)
    yield engine
    engine.close()


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_all_prompt_forms_give_the_same_output_in_input_order(llm):
    tok = llm.get_tokenizer()
    ids = tok("The dog named Max").input_ids
    forms = ["The dog named Max", ids, {"prompt_token_ids": ids}, {"prompt": "The dog named Max"}]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[0].prompt == "The dog named Max" and outs[1].prompt is None
    assert all(o.prompt_token_ids == ids for o in outs)
    mixed = llm.generate(["a", "The cat", "Paged attention"], GREEDY, use_tqdm=False)
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in ["a", "The cat", "Paged attention"]]
    assert texts(mixed) == texts(alone)


def test_output_fields(llm):
    out = llm.generate("The cat", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    assert out.finished and completion.finish_reason == "length" and len(completion.token_ids) == 5
    assert len(completion.logprobs) == 5
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and entry[token].logprob <= 0
        assert entry[token].logprob == max(e.logprob for e in entry.values())  # greedy picks the most likely
        assert entry[token].rank == 1
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)))
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(["The dog", "Once upon a time", "x y z"], [noise, seeded, noise], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate("Once upon a time", SamplingParams(temperature=0.9, seed=99, max_tokens=16,
                                                                  ignore_eos=True), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone


def test_eos_stops_with_reason_stop_unless_ignored(llm):
    eos = llm.get_tokenizer().eos_token_id
    prompt = [5, 6, 7]
    free = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[3]  # pretend the 4th greedy token is an EOS
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free.token_ids[:free.token_ids.index(stop_id) + 1]
    assert eos in llm.engine.eos_token_ids


def test_stop_strings_end_the_text_before_them(llm):
    free = llm.generate("Once upon", GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = free[4:7]
    assert stop and stop not in free[:4 + len(stop) - 1]
    out = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free[:free.index(stop)]
    kept = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == free[:free.index(stop) + len(stop)]


def test_a_stop_string_completed_by_the_last_allowed_token_still_reports_stop(llm):
    free = llm.generate("Once upon", GREEDY, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    n = 6
    text_n = tok.decode(free.token_ids[:n])
    stop = text_n[-2:]  # ends exactly with the 6th token
    assert stop.strip() and stop not in tok.decode(free.token_ids[:n - 1])
    out = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text


def test_max_tokens_and_max_model_len_cap_with_reason_length(llm):
    out = llm.generate("The cat", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    ids = list(range(3, 253))  # 250 of max_model_len 256
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = list(range(3, 40))
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-10:]


def test_streaming_deltas_add_up_to_the_final_text(llm):
    engine = llm.engine
    rid = engine.add_request(None, "Unicode text: café 🐱", SamplingParams(temperature=0.8, seed=3, max_tokens=40,
                                                                          ignore_eos=True))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            deltas.append(out.outputs[0].delta)
            final = out
    assert final.finished and "".join(deltas) == final.outputs[0].text
    assert len(deltas) == 40  # one output per step: CUMULATIVE streams every token


def test_delta_output_kind_hands_out_only_new_tokens(llm):
    engine = llm.engine
    engine.add_request("delta", "The cat", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                          output_kind=RequestOutputKind.DELTA))
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [out.outputs[0].token_ids for out in engine.step()]
    assert all(len(p) == 1 for p in pieces) and len(pieces) == 6


def test_abort_ends_the_request_at_the_next_step_and_frees_its_blocks(llm):
    engine = llm.engine
    keep = engine.add_request(None, "The dog", GREEDY)
    gone = engine.add_request(None, "The cat", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    delivered = {}
    for _ in range(2):
        for out in engine.step():
            delivered[out.request_id] = len(out.outputs[0].token_ids)
    assert delivered.get(gone, 0) >= 1
    engine.abort_request(gone)
    assert llm.stats()["running"] == 2  # not before the step boundary
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[gone].outputs[0].finish_reason == "abort"
    # nothing past what it had delivered: a step already in flight (asynchronous scheduling) is dropped
    assert len(finals[gone].outputs[0].token_ids) == delivered[gone]
    assert finals[keep].outputs[0].finish_reason == "length"


def test_block_map_shows_each_blocks_state_and_owner(llm):
    engine = llm.engine
    rid = engine.add_request(None, list(range(3, 40)), GREEDY)  # 37 tokens: 3 blocks
    engine.step()
    states = llm.block_map()
    assert len(states) == 64
    assert sorted(i for i, (state, owner) in enumerate(states) if owner == rid) == sorted(engine.kv_cache_manager.block_ids(rid))
    assert sum(state == "used" for state, _ in states) == llm.stats()["used_blocks"] == 3
    engine.abort_request(rid)
    engine.step()
    states = llm.block_map()
    assert sum(state == "cached" for state, _ in states) >= 2  # full blocks keep their prefix content
    assert all(state != "used" for state, _ in states)


def test_counters_for_rates(llm):
    before = llm.stats()
    llm.generate("The cat", GREEDY, use_tqdm=False)
    after = llm.stats()
    assert after["generated_tokens"] - before["generated_tokens"] == 12
    assert after["steps"] - before["steps"] == 12
    assert after["computed_tokens"] > after["generated_tokens"] - before["generated_tokens"]


def test_chat_applies_the_template(llm):
    conversation = [{"role": "user", "content": "Tell me a story."}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert tok.decode(out.prompt_token_ids) == expected
    both = llm.chat([conversation, conversation], GREEDY, use_tqdm=False)
    assert texts(both) == [out.outputs[0].text] * 2


def test_priority_list_and_stats(llm):
    outs = llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[1, 0])
    assert len(outs) == 2
    stats = llm.stats()
    assert set(stats) >= {"num_blocks", "free_blocks", "cached_blocks", "used_blocks", "running", "waiting",
                          "preemptions", "prefix_cache_hit_tokens", "prefix_cache_query_tokens", "kv_usage"}
    assert stats["num_blocks"] == 64 and stats["free_blocks"] == 64 and stats["kv_usage"] == 0


BAD_INPUTS = [
    (["x" * 0], GREEDY, "prompt is empty"),
    ([[5] * 250], SamplingParams(max_tokens=10), r"prompt \(250 tokens\) \+ max_tokens \(10\) = 260 exceeds max_model_len \(256\)"),
    ([[5] * 256], SamplingParams(max_tokens=None), "shorter than max_model_len"),
    ([[5, 100000]], GREEDY, r"prompt_token_ids\[1\] = 100000 is outside the vocabulary \[0, 384\)"),
    ([[-1]], GREEDY, "outside the vocabulary"),
    (["a", "b"], [GREEDY] * 3, "sampling_params has 3 entries but there are 2 prompts"),
]


@pytest.mark.parametrize("prompts, params, message", BAD_INPUTS)
def test_bad_input_names_the_field_and_the_engine_keeps_serving(llm, prompts, params, message):
    before = llm.generate("The cat", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts + ["fine prompt"] if isinstance(params, SamplingParams) else prompts, params,
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing half-queued
    assert llm.generate("The cat", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.5, "temperature"), ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"),
    ("top_k", -2, "top_k"), ("max_tokens", 0, "max_tokens"),  # top_k=0 means off, as in vLLM
])
def test_bad_sampling_params_raise_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_unknown_model_path_and_unsupported_architecture(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))
    import json, shutil
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_dir("llama"), bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(bad))


def test_pool_sizing_logs_and_refuses_a_pool_that_cannot_hold_one_request(tiny_model_dir, caplog):
    path = str(tiny_model_dir("llama"))
    with caplog.at_level("INFO", logger="pagednb"):
        LLM(path, kv_cache_memory=2**20, max_model_len=512).close()
    assert "KV cache: " in caplog.text and "max concurrency" in caplog.text
    with pytest.raises(ValueError, match=r"max_model_len=512 needs 32 blocks.*at most 64 fits.*kv_cache_memory"):
        LLM(path, num_kv_blocks=4, max_model_len=512)
    with pytest.raises(ValueError, match="max_model_len must be <= the model's max_position_embeddings"):
        LLM(path, max_model_len=100000)
    with pytest.raises(ValueError, match="block_size"):
        LLM(path, block_size=7)


def test_start_up_ends_with_a_full_garbage_collection(tiny_model_dir):
    """Start-up leaves many long-lived objects awaiting a full collection; serving must not be the one to
    pay for it (a ~250 ms pause in the first workload on the H200), so start-up ends with one."""
    events = []

    def record(phase, info):
        events.append((phase, info["generation"]))
    gc.callbacks.append(record)
    try:
        llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=16, max_model_len=256)
    finally:
        gc.callbacks.remove(record)
    llm.close()
    assert events[-2:] == [("start", 2), ("stop", 2)]


def test_close_frees_the_cache_and_refuses_more_work(tiny_model_dir):
    with LLM(str(tiny_model_dir("llama")), num_kv_blocks=16, max_model_len=256) as llm:
        llm.engine.add_request(None, "The cat", GREEDY)
        llm.engine.step()
    assert llm.engine.closed and llm.engine.runner.kv_caches == []
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("The cat", GREEDY, use_tqdm=False)
