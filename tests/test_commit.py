"""Step 4 of a round (commit) driven directly with literal tables, case by case."""

import chex
import jax.numpy as jnp
import numpy as np

from specjax import decode as decode_lib

EOS = 7


def _stop_table(seqs):
  span = max(len(s) for s in seqs)
  table = np.zeros((len(seqs), span), np.int32)
  for k, s in enumerate(seqs):
    table[k, span - len(s):] = s
  return jnp.asarray(table), jnp.asarray([len(s) for s in seqs], jnp.int32)


class RoomTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_budget_context_and_buffer(self):
    # columns: n, prompt_len, max_new, max_len -> room (buffer 128 slots, width 4)
    cases = [
        (10, 5, 8, 100, 3),       # budget: 8 - 5 generated
        (98, 90, 50, 100, 2),     # context: 100 - 98
        (120, 110, 50, 1000, 4),  # buffer: 128 - 4 - 120
        (13, 5, 8, 100, 0),       # budget spent
    ]
    n, prompt_len, max_new, max_len, want = map(jnp.asarray, zip(*cases))
    room = self.variant(decode_lib.room_left)(
        n, prompt_len, max_new, max_len, 128, 4)
    np.testing.assert_array_equal(room, want)


class StopHitsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_table(self):
    stop_seqs, stop_lens = _stop_table([[EOS], [1, 2], [4, 4, 4]])
    # Each row: committed tokens (prompt_len, n), candidates -> expected hits.
    rows = [
        ([5, 5, 5, 5], 2, [3, EOS, 5, EOS], [0, 1, 0, 1]),   # EOS anywhere
        ([5, 5, 5, 1], 2, [2, 9, 9, 9], [1, 0, 0, 0]),       # [1, 2] began last round
        ([5, 5, 5, 1], 4, [2, 9, 9, 9], [0, 0, 0, 0]),       # ... but the 1 is prompt
        ([5, 4, 4, 5], 1, [4, 4, 4, 4], [0, 0, 1, 1]),       # [4,4,4] needs 3 new 4s
        ([5, 4, 4, 5], 2, [5, 5, 5, 5], [0, 0, 0, 0]),       # nothing
    ]
    tokens = np.zeros((len(rows), 16), np.int32)
    n = np.zeros(len(rows), np.int32)
    prompt_len = np.zeros(len(rows), np.int32)
    for i, (committed, plen, _, _) in enumerate(rows):
      tokens[i, :len(committed)] = committed
      n[i], prompt_len[i] = len(committed), plen
    new = jnp.asarray([r[2] for r in rows], jnp.int32)
    hits = self.variant(decode_lib.stop_hits)(jnp.asarray(tokens), jnp.asarray(n),
                                              jnp.asarray(prompt_len), new, stop_seqs, stop_lens)
    np.testing.assert_array_equal(hits, np.array([r[3] for r in rows], bool))

  def test_length_zero_row_never_matches(self):
    stop_seqs = jnp.zeros((1, 1), jnp.int32)  # token 0, but length 0: "no stop sequences"
    hits = decode_lib.stop_hits(jnp.zeros((1, 8), jnp.int32), jnp.asarray([2]),
                                jnp.asarray([1]), jnp.zeros((1, 3), jnp.int32), stop_seqs,
                                jnp.zeros((1,), jnp.int32))
    self.assertFalse(bool(jnp.any(hits)))


class CommitCountTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_table(self):
    # columns: accepted a, room, hits over the γ+1 = 4 candidates, done -> count, stops,
    # at a stop hit
    cases = [
        (2, 10, [0, 0, 0, 0], False, 3, False, False),  # a accepted + one token
        (3, 10, [0, 0, 0, 0], False, 4, False, False),  # all accepted + bonus
        (3, 2, [0, 0, 0, 0], False, 2, True, False),    # cut by the room left: finished
        (3, 10, [0, 1, 0, 1], False, 2, True, True),    # cut just after the first stop
        (1, 10, [0, 0, 0, 1], False, 2, False, False),  # a stop past the commit: none
        (0, 10, [1, 0, 0, 0], False, 1, True, True),    # the correction token stops
        (3, 2, [0, 1, 0, 0], False, 2, True, True),     # a stop at the room's last token
        (2, 10, [0, 0, 0, 0], True, 0, False, False),   # finished rows commit nothing
        (2, 10, [1, 0, 0, 0], True, 0, False, False),   # ... nor stop again
        (0, 0, [0, 0, 0, 0], False, 0, True, False),    # no room at all
    ]
    a, room, hits, done, want_count, want_stop, want_hit = zip(*cases)
    count, stops, at_hit = self.variant(decode_lib.commit_count)(
        jnp.asarray(a), jnp.asarray(room), jnp.asarray(hits, bool), jnp.asarray(done))
    np.testing.assert_array_equal(count, want_count)
    np.testing.assert_array_equal(stops, want_stop)
    np.testing.assert_array_equal(at_hit, want_hit)


class UpdateStatsTest(chex.TestCase):

  def test_counts_only_live_rows(self):
    gamma = 3
    stats = decode_lib.Stats.zeros(3, gamma)
    overlap = jnp.asarray([[0.5, 0.25, 0.125]] * 3)
    out = decode_lib.update_stats(stats, jnp.asarray([True, True, False]),
                                  jnp.asarray([1, 3, 2]), jnp.asarray([2, 4, 0]), overlap)
    np.testing.assert_array_equal(out.rounds, [1, 1, 0])
    np.testing.assert_array_equal(out.accepted_at, [[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(out.committed_hist[:, 2], [1, 0, 0])
    np.testing.assert_array_equal(out.committed_hist[:, 4], [0, 1, 0])
    np.testing.assert_array_equal(out.overlap_count, [2, 3, 0])  # a=1 checked 2 positions
    np.testing.assert_allclose(out.overlap_sum, [0.75, 0.875, 0.0])
