"""specjax: lossless speculative decoding in JAX/Flax."""
from specjax.config import ModelConfig
from specjax.generation import GenerateResult, generate
from specjax.model import Model, init_model
