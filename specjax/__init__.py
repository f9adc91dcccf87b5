"""specjax: lossless speculative decoding in JAX/Flax."""
from specjax.config import ModelConfig
from specjax.generate import GenerateResult, generate
from specjax.model import Model, init_model
