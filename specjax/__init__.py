"""specjax: lossless speculative decoding in JAX/Flax."""
from specjax import rng as _rng

_rng.use_unrolled_threefry()  # before any program is traced (see specjax/rng.py)

from specjax.generation import Chunk, GenerateResult, Stream, generate, stream
from specjax.models.config import ModelConfig
from specjax.models.model import Model, init_model
from specjax.models.pretrained import load_pretrained
from specjax.models.quantization import quantize
from specjax.models.sharding import shard
from specjax.processors import constraints

__all__ = ["Chunk", "GenerateResult", "Stream", "constraints", "Model", "ModelConfig",
           "generate", "init_model", "load_pretrained", "quantize", "shard", "stream"]
