"""tandem: a compact LLM inference engine — prefill context parallelism + speculative decoding."""

from tandem.entrypoints.llm import LLM
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.structured_output.params import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
