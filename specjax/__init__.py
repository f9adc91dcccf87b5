"""specjax: lossless speculative decoding in JAX/Flax."""
from specjax import constraints
from specjax.config import ModelConfig
from specjax.generation import GenerateResult, generate
from specjax.model import Model, init_model
from specjax.pretrained import load_pretrained
from specjax.quantization import quantize
from specjax.sharding import shard

__all__ = ["GenerateResult", "constraints", "Model", "ModelConfig", "generate", "init_model",
           "load_pretrained", "quantize", "shard"]
