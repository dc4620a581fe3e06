"""vLLM's `LLM(...)` options that pagednb does not have: code written for vLLM gets a clear answer.

An option whose value asks for nothing pagednb lacks (vLLM's default, or a value meaning "off" or
"one GPU") is accepted and ignored, so `LLM(model, pipeline_parallel_size=1, disable_log_stats=True)`
runs unchanged. Any other value raises ValueError "pagednb does not support <name>=<value> (a vLLM
option)". Options vLLM and pagednb share (dtype, max_model_len, seed, ...) are EngineConfig fields and
never reach this table; a name neither knows is a TypeError listing pagednb's options (llm.py).
"""
from __future__ import annotations

_ANY = object()  # every value is harmless (logging, CPU-side knobs with no pagednb counterpart)

# name -> the values that ask for nothing pagednb lacks (the first is vLLM's default)
IGNORED_WHEN: dict[str, tuple] = {
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),
    "distributed_executor_backend": (None, "mp"),  # tensor-parallel workers are spawned processes
    "quantization": (None,),
    "calculate_kv_scales": (False,),
    "cpu_offload_gb": (0,),
    "swap_space": (4, 0),  # pagednb preempts by recomputing, never swaps: no CPU space to reserve
    "enable_lora": (False,),
    "max_loras": (1,),
    "max_lora_rank": (16,),
    "enable_prompt_adapter": (False,),
    "enable_chunked_prefill": (None, True),  # chunked prefill is always on in pagednb
    "enable_expert_parallel": (False,),
    "tokenizer_mode": ("auto",),
    "skip_tokenizer_init": (False,),
    "hf_overrides": (None,),
    "mm_processor_kwargs": (None,),
    "limit_mm_per_prompt": (None,),
    "compilation_config": (None,),
    "logits_processors": (None,),
    "override_pooler_config": (None,),
    "task": ("auto", "generate"),
    "runner": ("auto", "generate"),
    "disable_log_stats": (_ANY,),
    "disable_custom_all_reduce": (_ANY,),
    "disable_async_output_proc": (_ANY,),
    "max_seq_len_to_capture": (_ANY,),  # pagednb captures decode graphs by batch size
    "tokenizer_revision": (None,),
    "code_revision": (None,),
    "served_model_name": (_ANY,),
    # pagednb's logprobs are vLLM's default mode, raw_logprobs (engine/logprobs.py); the others
    # (raw_logits, processed_logprobs, processed_logits) are refused
    "logprobs_mode": ("raw_logprobs",),
}


def is_vllm_option(name: str) -> bool:
    return name in IGNORED_WHEN


def check_vllm_option(name: str, value: object) -> None:
    """Returns when the value is harmless (the option is then ignored); raises ValueError otherwise."""
    accepted = IGNORED_WHEN[name]
    if _ANY in accepted or any(_same(value, ok) for ok in accepted):
        return
    shown = " or ".join(repr(v) for v in accepted)
    raise ValueError(f"pagednb does not support {name}={value!r} (a vLLM option); it accepts and ignores only "
                     f"{name}={shown}. The README's 'Differences from vLLM' lists what pagednb does instead")


def _same(value: object, ok: object) -> bool:
    """Equal and of the same kind: True is not 1, 1.0 is 1 (as pagednb's int checks)."""
    if ok is None or isinstance(ok, bool) or isinstance(value, bool):
        return value is ok
    if isinstance(ok, int):
        return isinstance(value, (int, float)) and value == ok
    return type(value) is type(ok) and value == ok
