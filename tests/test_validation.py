"""Inputs checked at the door: every refused input below reads like the spec of what pagednb accepts.

Each refusal raises TypeError (wrong type) or ValueError (out of range) naming the field, before
anything is queued or allocated, and the engine keeps serving everyone else. Covered here: add-time
checks that need the model (vocabulary, prompt forms, priority, request ids), automatic request ids
that never collide with user ids, chat messages, LLM/EngineConfig options, model configs (refused
before any weight is allocated, with the estimated bytes) and safetensors indexes that point outside
the model folder. (SamplingParams' own table is in test_sampling_params.py.)
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_support import gpu
from tiny import VOCAB_SIZE

import pagednb.engine.llm_engine as llm_engine_module
from pagednb import LLM, SamplingParams
from pagednb.config import EngineConfig
from pagednb.model import WeightLoadError
from pagednb.model.loader import safetensors_files

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, max_model_len=256)
    yield engine
    engine.close()


@pytest.fixture(autouse=True)
def pool_is_clean_after_each_test(request):
    yield
    if "llm" in request.fixturenames:
        llm = request.getfixturevalue("llm")
        assert llm.stats()["used_blocks"] == 0 and not llm.engine.has_unfinished_requests()
        llm.engine.check_integrity()


def solo(llm, prompt, params=GREEDY) -> list[int]:
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def mutated(**fields) -> SamplingParams:
    """SamplingParams changed after construction (as a notebook user may do before adding it)."""
    params = SamplingParams()
    for name, value in fields.items():
        setattr(params, name, value)
    return params


# ---- at add time: the checks that need the model --------------------------------------------------------
# (field the message starts with, error, request_id, prompt, sampling_params, priority)
REFUSED_AT_ADD = [
    ("logprobs", ValueError, None, "The cat", SamplingParams(logprobs=VOCAB_SIZE + 1), 0),
    ("stop_token_ids[0]", ValueError, None, "The cat", SamplingParams(stop_token_ids=[10**6], min_tokens=2), 0),
    ("stop_token_ids[1]", ValueError, None, "The cat", SamplingParams(stop_token_ids=[1, VOCAB_SIZE]), 0),
    ("prompt", TypeError, None, 5, None, 0),
    ("prompt", TypeError, None, None, None, 0),
    ("prompt", TypeError, None, b"The cat", None, 0),
    ("prompt", TypeError, None, [1, 2.5], None, 0),
    ("prompt", TypeError, None, [1, True], None, 0),
    ("prompt", TypeError, None, [[1, 2], [3]], None, 0),
    ("prompt", TypeError, None, torch.tensor([[5, 6]]), None, 0),
    ("prompt", TypeError, None, torch.tensor([5.0, 6.0]), None, 0),
    ("prompt", ValueError, None, [], None, 0),
    ("prompt_token_ids[0]", ValueError, None, [2**70], None, 0),
    ("prompt['prompt']", TypeError, None, {"prompt": 5}, None, 0),
    ("prompt_token_ids", TypeError, None, {"prompt_token_ids": "abc"}, None, 0),
    ("prompt_token_ids", TypeError, None, {"prompt_token_ids": [1.5]}, None, 0),
    ("a prompt dict takes", ValueError, None, {"prompt_ids": [1, 2]}, None, 0),
    ("a prompt dict needs", ValueError, None, {}, None, 0),
    ("priority", TypeError, None, "The cat", None, True),
    ("priority", TypeError, None, "The cat", None, 1.5),
    ("priority", TypeError, None, "The cat", None, "high"),
    ("request_id", TypeError, 5, "The cat", None, 0),
    ("sampling_params", TypeError, None, "The cat", {"temperature": 0}, 0),
    ("top_k", TypeError, None, "The cat", mutated(top_k=2.5), 0),
    ("temperature", ValueError, None, "The cat", mutated(temperature=float("inf")), 0),
    ("logprobs", TypeError, None, "The cat", mutated(logprobs=True), 0),
    ("repetition_penalty", ValueError, None, "The cat", mutated(repetition_penalty=1e-40), 0),
]


@pytest.mark.parametrize("field, error, request_id, prompt, params, priority", REFUSED_AT_ADD,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(REFUSED_AT_ADD)])
def test_refused_at_add_names_the_field_and_changes_nothing(llm, field, error, request_id, prompt, params, priority):
    engine = llm.engine
    before = llm.stats()
    with pytest.raises(error) as info:
        engine.add_request(request_id, prompt, params, priority)
    assert type(info.value) is error and str(info.value).startswith(field)
    assert llm.stats() == before and not engine.has_unfinished_requests()


def test_refused_adds_between_steps_leave_running_requests_untouched(llm):
    """Bad requests arriving while others run: each is refused, and the running ones end exactly as
    they do alone."""
    prompts = ["The cat", "Once upon a time"]
    expected = [solo(llm, p) for p in prompts]
    ids = [llm.engine.add_request(None, p, GREEDY) for p in prompts]
    finals = {}
    for _, error, request_id, prompt, params, priority in REFUSED_AT_ADD:
        for out in llm.engine.step():
            if out.finished:
                finals[out.request_id] = out
        with pytest.raises(error):
            llm.engine.add_request(request_id, prompt, params, priority)
    while llm.engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in llm.engine.step() if o.finished)
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
    assert all(finals[i].outputs[0].finish_reason == "length" for i in ids)


def test_every_prompt_form_that_is_accepted_gives_the_same_tokens(llm):
    ids = llm.get_tokenizer()("The dog named Max").input_ids
    forms = [ids, tuple(ids), np.array(ids), np.array(ids, dtype=np.int32), torch.tensor(ids),
             [np.int64(t) for t in ids], {"prompt_token_ids": torch.tensor(ids)},
             {"prompt": "The dog named Max", "prompt_token_ids": ids}]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert all(o.outputs[0].token_ids == outs[0].outputs[0].token_ids for o in outs)
    assert all(type(t) is int for o in outs for t in o.prompt_token_ids)
    assert outs[-1].prompt == "The dog named Max"


def test_floats_for_ints_and_top_k_zero_are_accepted_like_their_ints(llm):
    base = SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=8, ignore_eos=True)
    as_floats = SamplingParams(temperature=0.8, top_k=40.0, seed=5.0, max_tokens=8.0, ignore_eos=True)
    assert solo(llm, "The cat", as_floats) == solo(llm, "The cat", base)
    off = [SamplingParams(temperature=0.8, top_k=k, seed=5, max_tokens=8, ignore_eos=True) for k in (0, -1)]
    assert solo(llm, "The cat", off[0]) == solo(llm, "The cat", off[1])


def test_top_p_that_would_underflow_samples_the_most_likely_token(llm):
    """top_p=1e-300 keeps only the most likely token (as it says), with no NaN on the way: at temperature 1
    it must reproduce greedy decoding token for token, in a batch with a normal request."""
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-300, seed=1, max_tokens=8, ignore_eos=True)
    other = SamplingParams(temperature=0.7, seed=3, max_tokens=8, ignore_eos=True)
    outs = llm.generate(["The cat", "The dog"], [tiny_p, other], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == solo(llm, "The cat")
    assert outs[1].outputs[0].token_ids == solo(llm, "The dog", other)


def test_the_smallest_accepted_repetition_penalty_finishes_normally(llm):
    """1e-6 is the floor (1e-40 made NaN logits and ended every request in the step)."""
    edge = SamplingParams(temperature=1.0, repetition_penalty=1e-6, seed=2, max_tokens=8, ignore_eos=True)
    outs = llm.generate(["The cat", "The dog"], [edge, GREEDY], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    assert all(0 <= t < VOCAB_SIZE for t in outs[0].outputs[0].token_ids)
    assert outs[1].outputs[0].token_ids == solo(llm, "The dog")


# ---- automatic request ids -----------------------------------------------------------------------------
def test_automatic_ids_never_collide_with_user_ids(tiny_model_dir):
    """A user may name requests "0" and "1" (what the automatic counter would produce next); automatic
    requests added while those run get other ids, and all of them finish."""
    with LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, max_model_len=256) as fresh:
        finals = {}

        def add(request_id):
            req = fresh.engine.make_request(request_id, "The cat", GREEDY)
            fresh.driver.submit(req, lambda out: finals.update({out.request_id: out}) if out.finished else None)
            return req.request_id

        user = [add("0"), add("1")]
        automatic = [add(None) for _ in range(3)]
        assert user == ["0", "1"] and len(set(automatic)) == 3 and not set(automatic) & set(user)
        outs = fresh.generate(["The dog", "The cat"], GREEDY, use_tqdm=False)  # automatic ids too, mid-flight
        assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
        fresh.driver.run_until(lambda: not fresh.engine.has_unfinished_requests())
        assert set(finals) == set(user) | set(automatic)
        assert all(out.outputs[0].token_ids == outs[1].outputs[0].token_ids for out in finals.values())
        with pytest.raises(ValueError, match="'7' is already in use"):
            fresh.engine.add_request("7", "The cat", GREEDY)
            fresh.engine.add_request("7", "The cat", GREEDY)
        fresh.abort("7")
        fresh.driver.step()


# ---- chat messages -------------------------------------------------------------------------------------
OK = {"role": "user", "content": "Hi"}
REFUSED_CHAT = [
    ("messages must be a list", TypeError, "Hi"),
    ("messages must be a list", TypeError, {"role": "user", "content": "Hi"}),
    ("messages[0] has no 'content'", ValueError, [{"role": "user"}]),
    ("messages[1] has no 'role'", ValueError, [OK, {"content": "x"}]),
    ("messages[1] must be a dict", TypeError, [OK, "and then"]),
    ("messages[0]['role'] must be a non-empty str", TypeError, [{"role": 1, "content": "Hi"}]),
    ("messages[0]['role'] must be a non-empty str", TypeError, [{"role": "", "content": "Hi"}]),
    ("messages[0]['content'] must be a str or a list of parts", TypeError, [{"role": "user", "content": None}]),
    ("messages[0]['content'] must be a str or a list of parts", TypeError, [{"role": "user", "content": 5}]),
    ("messages[0]['content'][0] must be a dict with a str 'type'", TypeError,
     [{"role": "user", "content": [{"text": "x"}]}]),
    ("messages[0]['content'][0]['text'] must be a str", TypeError,
     [{"role": "user", "content": [{"type": "text", "text": 3}]}]),
    ("messages[1][0]['content']", TypeError, [[OK], [{"role": "user", "content": 5}]]),
    ("messages[0] must be a list of messages", TypeError, [["Hi"][0]]),
    ("messages[1][0] must be a dict", TypeError, [[OK], ["Hi"]]),
]


@pytest.mark.parametrize("message, error, messages", REFUSED_CHAT, ids=[c[0] for c in REFUSED_CHAT])
def test_malformed_chat_messages_are_refused_naming_the_index(llm, message, error, messages):
    with pytest.raises(error) as info:
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert type(info.value) is error and str(info.value).startswith(message)


def test_chat_options_are_checked(llm):
    with pytest.raises(TypeError, match="^chat_template_kwargs must be a dict"):
        llm.chat([OK], GREEDY, use_tqdm=False, chat_template_kwargs="x")
    with pytest.raises(TypeError, match="^add_generation_prompt must be True or False"):
        llm.chat([OK], GREEDY, use_tqdm=False, add_generation_prompt="yes")
    assert llm.chat([OK], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving


# ---- LLM(...) / EngineConfig options -------------------------------------------------------------------
# (field, error, value, what the message says is accepted)
REFUSED_OPTIONS = [
    ("max_num_seqs", ValueError, 0, "an int in [1, 65,536]"),
    ("max_num_seqs", ValueError, 10**9, "an int in [1, 65,536]"),
    ("max_num_seqs", TypeError, True, "an int"),
    ("max_num_seqs", TypeError, 2.5, "an int"),
    ("num_kv_blocks", ValueError, 2**40, "block ids are int32"),
    ("num_kv_blocks", ValueError, 0, "None or an int in [1, "),
    ("max_num_batched_tokens", ValueError, 2**30, "None or an int in [1, 1,048,576]"),
    ("max_model_len", ValueError, 10**9, "None or an int in [1, 16,777,216]"),
    ("max_model_len", ValueError, -1, "None or an int in [1, "),
    ("max_cuda_graph_batch_size", ValueError, 10**6, "an int in [1, 2,048]"),
    ("kv_cache_memory", ValueError, 2**60, "16 TiB"),
    ("kv_cache_memory", ValueError, 0, "None or an int in [1, "),
    ("gpu_memory_utilization", ValueError, 0.0, "in (0, 1]"),
    ("gpu_memory_utilization", ValueError, 1.5, "in (0, 1]"),
    ("gpu_memory_utilization", ValueError, float("nan"), "in (0, 1]"),
    ("gpu_memory_utilization", TypeError, "0.9", "in (0, 1]"),
    ("block_size", ValueError, 7, "one of 8, 16, 32, 64, 128"),
    ("block_size", TypeError, 16.5, "one of 8, 16, 32, 64, 128"),
    ("block_size", TypeError, True, "one of 8, 16, 32, 64, 128"),
    ("dtype", ValueError, "int8", "one of ('auto'"),
    ("dtype", ValueError, torch.int8, "torch.float32, torch.float16 or torch.bfloat16"),
    ("dtype", TypeError, 16, "one of ('auto'"),
    ("device", ValueError, "tpu", "'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ("device", TypeError, 3, "'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ("scheduling_policy", ValueError, "lifo", "one of ('fcfs', 'priority')"),
    ("attention_backend", ValueError, "flash", "one of ('auto', 'torch_ref', 'cuda')"),
    ("seed", ValueError, -1, "an int in [0, "),
    ("seed", TypeError, 1.5, "an int in [0, "),
    ("enable_prefix_caching", TypeError, "yes", "True or False"),
    ("enforce_eager", TypeError, 1, "True or False"),
    ("async_scheduling", TypeError, "auto", "True or False"),
    ("trust_remote_code", TypeError, None, "True or False"),
    ("revision", TypeError, 5, "a str or None"),
    ("tokenizer", TypeError, 5, "a model folder or Hugging Face Hub id"),
]


@pytest.mark.parametrize("field, error, value, accepted", REFUSED_OPTIONS,
                         ids=[f"{f}={v!r}" for f, _, v, _ in REFUSED_OPTIONS])
def test_refused_option_names_the_field_and_the_limit_before_loading(monkeypatch, tiny_model_dir, field, error,
                                                                     value, accepted):
    with pytest.raises(error) as info:
        EngineConfig(model="some-model", **{field: value}).validate()
    message = str(info.value)
    assert type(info.value) is error and message.startswith(f"{field} must be ") and accepted in message
    spy = LoaderSpy(monkeypatch)
    with pytest.raises(error, match=f"^{field} must be "):
        LLM(str(tiny_model_dir("llama")), **{field: value})
    assert spy.calls == 0


@pytest.mark.parametrize("model, error", [(5, TypeError), ("", ValueError), (None, TypeError), (["m"], TypeError)])
def test_refused_model_argument(model, error):
    with pytest.raises(error, match="^model must be a model folder or Hugging Face Hub id"):
        EngineConfig(model=model).validate()


def test_accepted_options_are_normalised():
    config = EngineConfig(model=Path("m"), max_num_seqs=8.0, kv_cache_memory=2e9, block_size=32.0,
                          max_model_len=np.int64(128), seed=3.0, gpu_memory_utilization=1)
    config.validate()
    assert (config.model, config.max_num_seqs, config.kv_cache_memory, config.block_size, config.max_model_len,
            config.seed, config.gpu_memory_utilization) == ("m", 8, 2_000_000_000, 32, 128, 3, 1.0)
    assert all(type(v) is int for v in (config.max_num_seqs, config.kv_cache_memory, config.block_size,
                                        config.max_model_len, config.seed))


@pytest.mark.parametrize("call, message", [
    (lambda llm: llm.generate(5, use_tqdm=False), "^prompts must be"),
    (lambda llm: llm.generate("The cat", {"temperature": 0}, use_tqdm=False), "^sampling_params must be"),
    (lambda llm: llm.generate(["a", "b"], [GREEDY, "x"], use_tqdm=False), r"^sampling_params\[1\] must be"),
    (lambda llm: llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0, 1.5]), "^priority must be"),
    (lambda llm: llm.generate(["a", 5], GREEDY, use_tqdm=False), "^prompt must be"),
])
def test_llm_arguments_are_checked_before_anything_is_queued(llm, call, message):
    with pytest.raises(TypeError, match=message):
        call(llm)


# ---- model configs: refused before any allocation --------------------------------------------------------
class LoaderSpy:
    """Replaces the engine's load_model: a refusal must come before the weights are ever built."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        monkeypatch.setattr(llm_engine_module, "load_model", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise AssertionError("load_model was reached")


def model_with_config(source: Path, tmp_path: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    path = Path(shutil.copytree(source, tmp_path / "model"))
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    (path / "config.json").write_text(json.dumps(config))
    return path


# (what the message says, error, changes to config.json, keys dropped from it)
REFUSED_CONFIGS = [
    ("model config num_attention_heads must be an int >= 1, got 0", ValueError, {"num_attention_heads": 0}, ()),
    ("model config num_attention_heads must be an int >= 1, got -4", ValueError, {"num_attention_heads": -4}, ()),
    ("model config hidden_size must be an int >= 1, got 0", ValueError, {"hidden_size": 0}, ()),
    ("model config hidden_size must be an int >= 1, got '64'", TypeError, {"hidden_size": "64"}, ()),
    ("model config num_hidden_layers must be an int >= 1", ValueError, {"num_hidden_layers": 0}, ()),
    ("model config vocab_size must be an int >= 1", ValueError, {"vocab_size": -1}, ()),
    ("model config intermediate_size must be an int >= 1", TypeError, {"intermediate_size": None}, ()),
    ("model config max_position_embeddings must be an int >= 1", ValueError, {"max_position_embeddings": 0}, ()),
    ("model config head_dim must be None or an int >= 1", ValueError, {"head_dim": 0}, ()),
    ("model config head_dim must be even", ValueError, {"head_dim": 15}, ()),
    ("model config num_key_value_heads (3) must divide num_attention_heads (4)", ValueError,
     {"num_key_value_heads": 3}, ()),
    ("model config hidden_size (66) must be divisible by num_attention_heads (4)", ValueError, {"hidden_size": 66},
     ("head_dim",)),
    ("model config implies", ValueError, {"vocab_size": 10**12}, ()),  # 1.3e14 parameters
    ("model config implies", ValueError, {"num_hidden_layers": 10**9}, ()),
    ("model config implies", ValueError,
     {"num_attention_heads": 2**30, "num_key_value_heads": 2**30, "head_dim": 128}, ()),
]


@pytest.mark.parametrize("message, error, changes, drop", REFUSED_CONFIGS, ids=[str(c[2]) for c in REFUSED_CONFIGS])
def test_absurd_model_config_is_refused_before_any_allocation(monkeypatch, tiny_model_dir, tmp_path, message, error,
                                                              changes, drop):
    path = model_with_config(tiny_model_dir("llama"), tmp_path, drop, **changes)
    spy = LoaderSpy(monkeypatch)
    with pytest.raises(error) as info:
        LLM(str(path))
    assert type(info.value) is error and str(info.value).startswith(message)
    if message == "model config implies":
        assert "TiB in bfloat16" in str(info.value)  # the estimated bytes
    assert spy.calls == 0


@pytest.mark.parametrize("changes, options", [
    ({"hidden_size": 10**9}, {}),  # 1.9e12 parameters: 7 TiB of float32 weights
    ({"max_position_embeddings": 2**40}, {}),  # a rotary table of 128 TiB, and block tables as big
    ({}, {"num_kv_blocks": 2**31 - 1}),  # 16 TiB of KV cache
])
def test_a_start_up_that_cannot_fit_in_memory_states_the_estimate(monkeypatch, tiny_model_dir, tmp_path, changes,
                                                                   options):
    path = model_with_config(tiny_model_dir("llama"), tmp_path, **changes)
    spy = LoaderSpy(monkeypatch)
    with pytest.raises(ValueError, match=r"needs an estimated [\d,.]+ TiB \(.*\), more than the .* of host memory"):
        LLM(str(path), device="cpu", **options)
    assert spy.calls == 0


@gpu
def test_a_gpu_start_up_that_cannot_fit_states_the_estimate_and_allocates_nothing(monkeypatch, tiny_model_dir):
    """num_kv_blocks of 16 TiB on the GPU: refused against the free memory, before the weights exist."""
    spy = LoaderSpy(monkeypatch)
    allocated = torch.cuda.memory_allocated()
    with pytest.raises(ValueError, match=r"needs an estimated [\d,.]+ TiB .*more than the .* of free memory on cuda"):
        LLM(str(tiny_model_dir("llama")), device="cuda", num_kv_blocks=2**31 - 1)
    assert spy.calls == 0 and torch.cuda.memory_allocated() == allocated


def test_layer_types_that_do_not_match_the_layers_are_refused():
    from pagednb.model import model_spec
    from tiny import tiny_config
    cfg = tiny_config("qwen3", use_sliding_window=True, sliding_window=10)
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.layer_types = ["sliding_attention"] * 3  # the model has 2 layers
    with pytest.raises(ValueError, match="gives 3 layer types .* for num_hidden_layers=2"):
        model_spec(cfg)


# ---- safetensors index: shards stay inside the model folder ------------------------------------------------
def write_index(path: Path, shard) -> None:
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    weight_map = {name: "model.safetensors" for name in names}
    weight_map[names[0]] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shard", ["../x.safetensors", "../model/model.safetensors", "/etc/x.safetensors",
                                   "sub/../../x.safetensors", "C:\\x.safetensors", "\\\\server\\x.safetensors",
                                   "model.bin", "", 5])
def test_index_entries_outside_the_model_folder_are_refused(tiny_model_dir, tmp_path, shard):
    path = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "model"))
    write_index(path, shard)
    with pytest.raises(WeightLoadError, match="model.safetensors.index.json") as info:
        safetensors_files(path)
    assert "inside the model folder" in str(info.value) or "must name a shard file" in str(info.value)


def test_index_entries_inside_the_folder_load_even_through_links(tiny_model_dir, tmp_path):
    """The Hub cache links every file to a blob outside the snapshot folder: the check is on the names the
    index gives, not where links lead."""
    path = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "model"))
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.move(path / "model.safetensors", blobs / "abc123")
    (path / "sub").mkdir()
    (path / "sub" / "shard.safetensors").symlink_to(blobs / "abc123")
    (path / "model.safetensors").symlink_to(blobs / "abc123")
    write_index(path, "sub/shard.safetensors")
    assert safetensors_files(path) == [path / "model.safetensors", path / "sub" / "shard.safetensors"]
    with LLM(str(path), num_kv_blocks=16, max_model_len=64) as linked:
        assert linked.generate("The cat", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"
