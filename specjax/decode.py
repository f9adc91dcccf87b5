"""The jitted decode engine: prefill, then one `lax.while_loop` over rounds.

One round (γ ≥ 0; γ = 0 is plain autoregressive decoding):
  1. the drafter proposes y_1..y_γ with their distributions q (inside the jit);
  2. the target scores [x_{n-1}, y_1..y_γ] in one cached pass -> p_1..p_{γ+1};
  3. `verify` (vmapped over rows) accepts a prefix and draws the correction/bonus token;
  4. the accepted prefix plus that token is committed, truncated by EOS, the token
     budget and the context limit;
  5. both caches roll back to the committed history: the token just committed has no
     KV yet, it is the first input of the next round.
Rows accept different counts; each row's own `n` and KV `length` absorb it.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import kv_cache
from specjax import model as model_lib
from specjax.sampling import process_logits
from specjax.verify import verify_batch


@flax.struct.dataclass
class Sampling:
  """Traced per-row sampling settings (one compile serves every value)."""
  temperature: jax.Array  # float32[B]; 0 = greedy
  top_k: jax.Array  # int32[B]; 0 = off
  top_p: jax.Array  # float32[B]; 1 = off
  max_new: jax.Array  # int32[B]
  stop_seqs: jax.Array  # int32[K, L] stop sequences, right-aligned; EOS ids are length 1
  stop_lens: jax.Array  # int32[K]; a length-0 row never matches


@flax.struct.dataclass
class Stats:
  """Per-row counters, summed on the host."""
  rounds: jax.Array  # int32[B] rounds in which the row was still running
  drafted: jax.Array  # int32[B]
  accepted: jax.Array  # int32[B] draft tokens accepted by verification
  committed: jax.Array  # int32[B] tokens committed (after stop truncation)
  accepted_at: jax.Array  # int32[B, γ] times position i was accepted
  committed_hist: jax.Array  # int32[B, γ+2] histogram of tokens committed per round
  overlap_sum: jax.Array  # float32[B] Σ over verified positions of Σ_x min(p, q)
  overlap_count: jax.Array  # int32[B] verified positions


@flax.struct.dataclass
class DecodeState:
  tokens: jax.Array  # int32[B, S] prompt + committed tokens
  n: jax.Array  # int32[B] committed length (prompt included)
  prompt_len: jax.Array  # int32[B]
  done: jax.Array  # bool[B]
  target_kv: kv_cache.KVState
  draft_state: Any
  key: jax.Array
  target_calls: jax.Array  # int32: batched target passes in the loop
  stats: Stats


def _init_stats(batch, gamma):
  zi = lambda *s: jnp.zeros((batch,) + s, jnp.int32)
  return Stats(rounds=zi(), drafted=zi(), accepted=zi(), committed=zi(),
               accepted_at=zi(gamma), committed_hist=zi(gamma + 2),
               overlap_sum=jnp.zeros((batch,), jnp.float32), overlap_count=zi())


def _commit_length(new, n_accepted, state: DecodeState, sampling: Sampling, max_len):
  """How many of the γ+1 candidate tokens to commit, and whether the row stops.

  The commit ends at the budget, the context limit, or just after the first token that
  completes a stop sequence (EOS is a stop sequence of length 1) lying wholly inside the
  generated text; the stop tokens themselves are emitted.
  """
  width = new.shape[1]
  generated = state.n - state.prompt_len
  # The next round writes up to index n + γ of the buffers: stop before they would overflow.
  capacity = state.tokens.shape[1] - width - state.n
  room = jnp.minimum(jnp.minimum(sampling.max_new - generated, max_len - state.n), capacity)
  count = jnp.minimum(n_accepted + 1, room)
  span = sampling.stop_seqs.shape[1]
  # The last span-1 committed tokens, then the candidates: windows ending at each candidate.
  history = jnp.take_along_axis(state.tokens, state.n[:, None] - (span - 1)
                                + jnp.arange(span - 1)[None, :], axis=1, mode="clip")
  seq = jnp.concatenate([history, new], axis=1)  # [B, span-1+width]
  windows = jnp.stack([seq[:, j:j + span] for j in range(width)], axis=1)  # [B, width, span]
  col = jnp.arange(span)
  in_seq = col[None, :] >= span - sampling.stop_lens[:, None]  # [K, span]
  same = (windows[:, :, None, :] == sampling.stop_seqs[None, None]) | ~in_seq[None, None]
  idx = jnp.arange(width)[None, :]
  starts = state.n[:, None] + idx  # absolute index of each candidate
  inside = (starts[:, :, None] - sampling.stop_lens[None, None, :] + 1
            >= state.prompt_len[:, None, None])
  hit = jnp.any(jnp.all(same, axis=-1) & inside & (sampling.stop_lens > 0), axis=-1)
  hit &= idx < count[:, None]
  stopped = jnp.any(hit, axis=1)
  count = jnp.where(stopped, jnp.argmax(hit, axis=1) + 1, count)
  count = jnp.where(state.done, 0, count)
  return count, stopped | (count >= room)


def decode_round(target_config, drafter, target_params, draft_params, state: DecodeState,
                 sampling: Sampling) -> DecodeState:
  """One draft + verify round for every row: a pure function of its inputs."""
  batch = state.n.shape[0]
  gamma = drafter.gamma
  key, draft_key, verify_key = jax.random.split(state.key, 3)

  ys, qs, draft_state = drafter.propose(draft_params, state.draft_state, state.tokens,
                                        state.n, draft_key, sampling)
  pending = jnp.take_along_axis(state.tokens, (state.n - 1)[:, None], axis=1)
  logits, target_kv = model_lib.forward_cached(
      model_lib.graphdef_for(target_config), target_params,
      jnp.concatenate([pending, ys], axis=1), state.target_kv)
  ps = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)

  row_keys = jax.vmap(jax.random.fold_in, (None, 0))(verify_key, jnp.arange(batch))
  n_accepted, next_token, overlap = verify_batch(row_keys, ys, qs, ps)

  # The accepted prefix y_1..y_a, then the correction/bonus token at index a.
  idx = jnp.arange(gamma + 1)[None, :]
  padded = jnp.concatenate([ys, next_token[:, None]], axis=1)
  new = jnp.where(idx == n_accepted[:, None], next_token[:, None], padded)  # [B, γ+1]
  count, stop = _commit_length(new, n_accepted, state, sampling, target_config.max_len)
  old = jnp.take_along_axis(state.tokens, state.n[:, None] + idx, axis=1, mode="clip")
  tokens = kv_cache.write(state.tokens, jnp.where(idx < count[:, None], new, old), state.n)
  n = state.n + count

  live = ~state.done
  verified = jnp.minimum(n_accepted + 1, gamma)  # positions whose draft token was checked
  s = state.stats
  li = live.astype(jnp.int32)
  stats = Stats(
      rounds=s.rounds + li,
      drafted=s.drafted + gamma * li,
      accepted=s.accepted + n_accepted * li,
      committed=s.committed + count,
      accepted_at=s.accepted_at + (jnp.arange(gamma)[None, :] < n_accepted[:, None]) * li[:, None],
      committed_hist=s.committed_hist + jax.nn.one_hot(count, gamma + 2, dtype=jnp.int32)
      * li[:, None],
      overlap_sum=s.overlap_sum + jnp.where(
          live, jnp.sum(jnp.where(jnp.arange(gamma)[None, :] < verified[:, None], overlap, 0.0),
                        axis=1), 0.0),
      overlap_count=s.overlap_count + verified * li,
  )
  return state.replace(
      tokens=tokens, n=n, done=state.done | stop,
      target_kv=target_kv.rollback(n - 1),
      draft_state=drafter.rollback(draft_state, n),
      key=key, target_calls=state.target_calls + 1, stats=stats)


def prefill(target_config, drafter, target_params, draft_params, tokens, prompt_len,
            prompt_width, cache_size, key) -> DecodeState:
  """Builds both caches from the prompts; the last prompt token stays pending."""
  batch = tokens.shape[0]
  head = tokens[:, :prompt_width]
  target_kv = kv_cache.init_kv(target_config, batch, cache_size)
  _, target_kv = model_lib.forward_cached(model_lib.graphdef_for(target_config), target_params,
                                          head, target_kv, empty=True)
  draft_state = drafter.init(batch, cache_size)
  draft_state = drafter.prefill(draft_params, draft_state, head, prompt_len)
  return DecodeState(
      tokens=tokens, n=prompt_len, prompt_len=prompt_len,
      done=jnp.zeros((batch,), bool), target_kv=target_kv.rollback(prompt_len - 1),
      draft_state=draft_state, key=key, target_calls=jnp.zeros((), jnp.int32),
      stats=_init_stats(batch, drafter.gamma))


def run_loop(target_config, drafter, target_params, draft_params, state, sampling):
  """All rounds in one while_loop; no host sync until every row is done."""
  body = functools.partial(decode_round, target_config, drafter, target_params, draft_params,
                           sampling=sampling)
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: body(state=s), state)


# Static arguments are configs, not NNX graphdefs: the graph is a function of the config
# (`graphdef_for`), and a frozen dataclass hashes in microseconds where a graphdef takes
# about a millisecond on every call.
@functools.partial(jax.jit, static_argnames=("target_config", "drafter", "prompt_width",
                                             "cache_size"))
def decode(target_config, drafter, prompt_width, cache_size, target_params, draft_params,
           tokens, prompt_len, sampling: Sampling, key) -> DecodeState:
  """Prefill + every round, compiled once per (configs, γ, shapes)."""
  state = prefill(target_config, drafter, target_params, draft_params, tokens, prompt_len,
                  prompt_width, cache_size, key)
  return run_loop(target_config, drafter, target_params, draft_params, state, sampling)
