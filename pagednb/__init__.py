"""pagednb: a small, fast paged-attention LLM engine that runs inside the notebook kernel."""
from pagednb.llm import LLM
from pagednb.log import configure_default_logging, set_log_level
from pagednb.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagednb.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "RequestOutputKind",
           "Logprob", "StructuredOutputsParams", "set_log_level"]
__version__ = "0.1.0"

configure_default_logging()  # say what the engine decided (pool size, model load) unless the user set logging up
