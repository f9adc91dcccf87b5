"""specjax: lossless speculative decoding in JAX/Flax."""

from specjax.generation import Chunk, GenerateResult, Stream, generate, stream
from specjax.models.config import ModelConfig
from specjax.models.model import Model, init_model
from specjax.models.pretrained import load_pretrained
from specjax.models.quantization import quantize
from specjax.models.sharding import shard
from specjax.params import OutputParams, SamplingParams, SpeculationParams, StoppingParams
from specjax.processors import constraints
from specjax.trees import DynamicTree

__all__ = ["Chunk", "DynamicTree", "GenerateResult", "Model", "ModelConfig", "OutputParams", "SamplingParams",
           "SpeculationParams", "StoppingParams", "Stream", "constraints", "generate",
           "init_model", "load_pretrained", "quantize", "shard", "stream"]
