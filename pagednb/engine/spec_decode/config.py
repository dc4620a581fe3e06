"""`speculative_config` as vLLM spells it, checked at the door: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": 4, "prompt_lookup_min": 1}."""
from __future__ import annotations

from dataclasses import dataclass

from pagednb.validation import as_choice, as_int

METHODS = ("ngram",)
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
MAX_SPECULATIVE_TOKENS = 16  # each draft is a row of the verify step: more only costs rows that rarely pass
MAX_LOOKUP = 64  # the longest n-gram searched for (each extra n compares the candidates once more)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    @classmethod
    def from_dict(cls, options: object) -> SpeculativeConfig:
        """Checks the dict; a missing lookup bound takes the other's value, both missing take 5 (vLLM's rule)."""
        if not isinstance(options, dict):
            raise TypeError(f"speculative_config must be None or a dict with keys {KEYS}, got {options!r}")
        unknown = [key for key in options if key not in KEYS]
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}: the accepted keys are {KEYS}")
        for key in ("method", "num_speculative_tokens"):
            if key not in options:
                raise ValueError(f"speculative_config needs {key!r} (accepted keys: {KEYS})")
        method = as_choice("speculative_config['method']", options["method"], METHODS)
        k = as_int("speculative_config['num_speculative_tokens']", options["num_speculative_tokens"],
                   f"an int in [1, {MAX_SPECULATIVE_TOKENS}]", 1, MAX_SPECULATIVE_TOKENS)
        high, low = options.get("prompt_lookup_max"), options.get("prompt_lookup_min")
        if high is None and low is None:
            high = low = 5
        elif high is None:
            high = low
        elif low is None:
            low = high
        accepted = f"an int in [1, {MAX_LOOKUP}]"
        high = as_int("speculative_config['prompt_lookup_max']", high, accepted, 1, MAX_LOOKUP)
        low = as_int("speculative_config['prompt_lookup_min']", low, accepted, 1, MAX_LOOKUP)
        if low > high:
            raise ValueError(f"speculative_config['prompt_lookup_min'] must be <= prompt_lookup_max ({high}), "
                             f"got {low}")
        return cls(method, k, high, low)
