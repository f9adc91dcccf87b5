"""`specjax.generate` and `specjax.stream`: the public API.

Both check every input on the host (`specjax.arguments`), lay the batch out for the
engine (`specjax.prepare`), run the jitted decode loop (`specjax.decode`) and hand the
result back (`specjax.results`). Settings come as four groups (`specjax.params`:
sampling, stopping, speculation, output) or as the same fields in flat keywords.
"""

from __future__ import annotations

from specjax import arguments
from specjax import checks
from specjax import params as params_lib
from specjax.models.model import Model
from specjax.prepare import Prepared, prepare, prepare_resolved, seed_key
from specjax.results import Chunk, GenerateResult, Stream, build_result

__all__ = ["Chunk", "GenerateResult", "Prepared", "Stream", "generate", "prepare", "stream"]


def generate(target: Model, prompts, *, seed: int = 0, mesh=None,
             sampling: params_lib.SamplingParams | None = None,
             stopping: params_lib.StoppingParams | None = None,
             speculation: params_lib.SpeculationParams | None = None,
             output: params_lib.OutputParams | None = None, **settings) -> GenerateResult:
  """Generates up to `max_new_tokens` new tokens for each prompt.

  With no draft and `drafter=None` this is plain autoregressive decoding. With a draft
  model, a draft head or `drafter='ngram'` it is lossless speculative decoding: at any
  temperature the output follows the target's distribution, and at temperature 0 it
  equals the target's greedy output.

      specjax.generate(target, prompts, max_new_tokens=64, temperature=1.0, draft=draft)
      specjax.generate(target, prompts, sampling=specjax.SamplingParams(temperature=1.0),
                       speculation=specjax.SpeculationParams(draft=draft, gamma=4))

  Args:
    target: the model whose distribution the output follows.
    prompts: a list of prompts, each a list of token ids or, when the target has a
      tokenizer, a string (encoded as transformers' tokenizer(text) and vLLM encode a
      prompt: with the BOS a Llama tokenizer's post-processor adds). Prompts may differ
      in length: pass them unpadded (a 2-D array is a batch of equal-length prompts,
      every id a prompt token: there is no attention mask).
    seed: PRNG seed for the whole batch, 0 <= seed < 2**32; rows draw independent random
      numbers from it by their index in the batch, so with temperature > 0 a prompt's
      sample depends on its row and the batch's size, not on the seed alone as a
      per-request seed in vLLM does; a greedy row's tokens depend on neither.
    mesh: a jax Mesh with axes ('data', 'model') to run on several devices: the target
      split over 'model' (pass `specjax.shard(target, mesh)` to place it once), the
      draft replicated, the batch over 'data' (padded with copies of the last prompt,
      dropped again). Same seed, same tokens as one device.
    sampling, stopping, speculation, output: the settings' groups (`specjax.params`,
      each field documented there); any field may instead be a flat keyword
      (max_new_tokens=64, temperature=0.8, draft=draft, gamma=4, logprobs=True, n=2, ...),
      but not both.
  """
  seed = arguments.check_seed(seed)
  given = params_lib.resolve(settings, "generate", sampling=sampling, stopping=stopping,
                             speculation=speculation, output=output)
  prepared = prepare_resolved(target, prompts, given, mesh)
  return build_result(target, prepared.engine, prepared.run(seed_key(seed)), prepared.stops)


def stream(target: Model, prompts, *, rounds_per_chunk: int = 1, seed: int = 0, mesh=None,
           sampling: params_lib.SamplingParams | None = None,
           stopping: params_lib.StoppingParams | None = None,
           speculation: params_lib.SpeculationParams | None = None,
           output: params_lib.OutputParams | None = None, **settings) -> Stream:
  """`generate`, handing out each row's new tokens (and text) as the rounds commit them.

  Takes `generate`'s arguments and `rounds_per_chunk`: how many rounds run between two
  chunks (each chunk is one call of a program compiled once, and a host read). Iterate
  for `Chunk`s; afterwards `.result` is what `generate` returns for the same arguments
  and seed: the same tokens, the same stats (rounds in chunks draw the same random
  numbers as in one call). Everything is checked before anything runs.

      for chunk in specjax.stream(target, ["def f(x):"], draft=draft, gamma=4):
        print(chunk.texts[0], end="", flush=True)
  """
  rounds = checks.int_at_least("rounds_per_chunk", rounds_per_chunk, 1)
  if rounds > 2 ** 30:  # the round limit is an int32 in the compiled loop
    raise ValueError(f"rounds_per_chunk must be <= 2**30, got {rounds}")
  key = seed_key(arguments.check_seed(seed))
  given = params_lib.resolve(settings, "stream", sampling=sampling, stopping=stopping,
                             speculation=speculation, output=output)
  return Stream(target, prepare_resolved(target, prompts, given, mesh), key, rounds)
