"""Token trees: exact node rules, the law of whole continuations, greedy equality, tree
attention and KV compaction."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import specjax
from specjax.processors import constraints
from specjax import decode as decode_lib
from specjax import drafters
from specjax import generation
from specjax.models import kv_cache
from specjax.models import model as model_lib
from specjax import trees
from specjax.drafters import trees as tree_drafters
from specjax.verify import tree as tree_verify
from conftest import (LAW_ROWS, PROMPTS, exact_continuations, greedy_oracle, target_and_draft,
                      tempered, tiny_model, within_law)
from test_processors import EOS, PROMPT as PROC_PROMPT, exact_law, law_check


def node_law(p, q, children, rule):
  """float64 law of the token a node emits (accepted child or final draw), given its
  children's tokens, under
    'sampled': children drawn from q without replacement (the drafter's order), judged
      by recursive rejection against q minus the siblings already tried; once q's
      support is used up the remaining children are fixed tokens (point-mass rule);
    'iid': the rule for i.i.d. children (q never loses the tried siblings), which is
      wrong for children drawn without replacement;
    'topk': point masses; 'wrong': top-k children judged as if they were samples from
      q (min(1, p/q), residual [p - q]_+), the mistake the docs warn about."""
  out = np.zeros_like(p)
  reach = 1.0
  dist = p.copy()
  left = q.copy()
  for x in children:
    drawn = left.sum() > 0 if rule == "sampled" else rule in ("iid", "wrong")
    if drawn:
      qx = left / left.sum() if rule == "sampled" else q
      a = min(1.0, dist[x] / qx[x]) if qx[x] > 0 else 1.0
      out[x] += reach * a
      reach *= 1 - a
      r = np.maximum(dist - qx, 0.0)  # the residual, in float64
      dist = r / r.sum() if r.sum() > 0 else dist
      left = left * (1 - np.eye(len(p))[x])
    else:
      onehot = np.eye(len(p))[x]
      a = dist[x]
      out[x] += reach * a
      reach *= 1 - a
      dist = dist * (1 - onehot)
      dist = dist / dist.sum() if dist.sum() > 0 else dist
  return out + reach * dist


def distinct_draws(q, k, fallback):
  """Every ordered draw of k children from q without replacement, with its probability;
  past q's support the children are `fallback`'s next tokens (fixed, as in the drafter)."""
  out = []

  def grow(seq, prob, left):
    if len(seq) == k:
      out.append((seq, prob))
      return
    if left.sum() <= 0:
      rest = [t for t in fallback if t not in seq][:k - len(seq)]
      out.append((seq + rest, prob))
      return
    for x in np.flatnonzero(left):
      grow(seq + [int(x)], prob * left[x] / left.sum(), left * (1 - np.eye(len(q))[x]))

  grow([], 1.0, q.copy())
  return out


class NodeRuleTest(parameterized.TestCase):

  @parameterized.parameters((0, 4), (1, 4), (2, 2), (3, 1))
  def test_sampled_children_give_p_and_the_iid_rule_does_not(self, seed, support):
    """Children drawn without replacement emit p under the sampled rule, also when q's
    support (`support` of 5 tokens) runs out before the 3 children do."""
    rng = np.random.default_rng(seed)
    vocab, k = 5, 3
    p = rng.dirichlet(np.ones(vocab) * 0.5)
    q = np.zeros(vocab)
    q[rng.permutation(vocab)[:support]] = rng.dirichlet(np.ones(support) * 0.5)
    fallback = list(rng.permutation(vocab))
    draws = distinct_draws(q, k, fallback)
    self.assertAlmostEqual(sum(w for _, w in draws), 1.0)
    law = sum(w * node_law(p, q, kids, "sampled") for kids, w in draws)
    np.testing.assert_allclose(law, p, atol=1e-6)
    if support >= k:  # all children drawn: only the update of q tells the rules apart
      iid = sum(w * node_law(p, q, kids, "iid") for kids, w in draws)
      self.assertGreater(np.abs(iid - p).sum(), 1e-3)

  @parameterized.parameters(range(4))
  def test_topk_children_give_p_and_the_wrong_rule_does_not(self, seed):
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.ones(6) * 0.5), rng.dirichlet(np.ones(6) * 0.5)
    children = list(np.argsort(-q)[:3])  # the draft's top-3: point masses, not draws
    np.testing.assert_allclose(node_law(p, q, children, "topk"), p, atol=1e-6)
    wrong = node_law(p, q, children, "wrong")
    self.assertGreater(np.abs(wrong - p).sum(), 1e-2)

  def test_walk_samples_the_law(self):
    """The jitted walk at one node (3 children, leaves) emits p: Monte Carlo bound. Sampled
    children come from the drafter's own draws without replacement, from a q of full
    support, of support 2 (the third child is a fixed token), and with a tail of 1e-32
    (the walk must renormalise it exactly); top-k children are point masses."""
    tree = trees.Tree.from_branching((3,))
    rng = np.random.default_rng(7)
    vocab, rows = 5, 40000
    p, q = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
    cases = [("topk", q), ("full", q), ("support_2", np.array([0.0, 0.7, 0.0, 0.3, 0.0])),
             ("tiny_tail", np.array([1.0, 1e-32, 0.0, 0.0, 0.0]))]
    walk = jax.jit(tree_verify.walk_batch, static_argnums=(4, 5))
    for name, q in cases:
      keys = jax.random.split(jax.random.PRNGKey(1), rows)
      draft_keys = jax.random.split(jax.random.PRNGKey(2), rows)
      qf = jnp.asarray(q, jnp.float32)
      if name == "topk":
        kids = jnp.broadcast_to(jnp.asarray(np.argsort(-q)[:3], jnp.int32), (rows, 3))
      else:  # past the support: the best of these logits
        kids = jax.vmap(lambda k: tree_drafters.sample_distinct(
            k, qf, -jnp.arange(vocab, dtype=jnp.float32), 3))(draft_keys)
        self.assertTrue(np.all(np.sort(np.asarray(kids), 1)[:, 1:]
                               != np.sort(np.asarray(kids), 1)[:, :-1]), name)  # distinct
      ps = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (rows, 4, vocab))
      qs = jnp.broadcast_to(qf, (rows, 3, vocab))
      a, nxt, _, path, (tried, taken, chance) = walk(keys, kids, qs, ps, tree, name == "topk")
      tried, taken, chance = (np.asarray(x).sum(0) for x in (tried, taken, chance))
      # Every row tries rank 0; rank r+1 exactly when rank r was tried and rejected; the
      # accepted tries match the summed acceptance probabilities within 5 sd.
      np.testing.assert_array_equal(tried, [rows, rows - taken[0], rows - taken[:2].sum()])
      self.assertEqual(taken.sum(), int(np.sum(np.asarray(a))))
      self.assertTrue(np.all(np.abs(taken - chance) <= 5 * np.sqrt(chance) + 1), (name, taken,
                                                                                  chance))
      first = np.where(np.asarray(a) > 0, np.take_along_axis(
          np.asarray(kids), np.maximum(np.asarray(path), 0), 1)[:, 0], np.asarray(nxt))
      freq = np.bincount(first, minlength=vocab) / rows
      bound = 5 * np.sqrt(p * (1 - p) / rows) + 1e-3
      self.assertTrue(np.all(np.abs(freq - p) <= bound), (name, freq, p))

  @parameterized.parameters(True, False)
  def test_rolled_and_unrolled_walks_agree(self, deterministic):
    """The walk's loops are rolled on a CPU and unrolled elsewhere (verify.tree.walk): the same
    tokens, paths and counts, on a tree whose walks end at every depth."""
    tree = trees.Tree.from_branching((3, 2, 1))
    rows, vocab, n = 64, 6, tree.num_nodes
    rng = np.random.default_rng(3)
    ps = jnp.asarray(rng.dirichlet(np.ones(vocab) * 0.3, (rows, n + 1)), jnp.float32)
    qs = jnp.asarray(rng.dirichlet(np.ones(vocab) * 0.3, (rows, n)), jnp.float32)
    kids = jnp.asarray(rng.integers(0, vocab, (rows, n)), jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(5), rows)
    fns = [jax.vmap(functools.partial(tree_verify.walk, tree=tree, deterministic=deterministic,
                                      unroll=u)) for u in (False, True)]
    lowered = [jax.jit(f).lower(keys, kids, qs, ps) for f in fns]
    loops = [low.as_text().count("stablehlo.while") for low in lowered]
    self.assertEqual(loops[0] - loops[1], 2)  # the depth and sibling loops (rng may add)
    outs = [low.compile()(keys, kids, qs, ps) for low in lowered]
    rolled, unrolled = (jax.tree_util.tree_leaves(o) for o in outs)
    for a, b in zip(rolled, unrolled):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    self.assertEqual(len(set(np.asarray(rolled[0]).tolist())), tree.depth + 1)  # 0..3 accepted


class LawTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("sampled_22_T1", (2, 2), "probabilistic", 1.0, 1.0),
      ("topk_211_T08_topp", (2, 1, 1), "greedy", 0.8, 0.9),
      ("sampled_paths_T08", [(0,), (1,), (0, 0), (1, 0), (1, 1)], "probabilistic", 0.8, 1.0),
      ("chain_as_tree", (1, 1, 1), "probabilistic", 1.0, 1.0))
  def test_three_token_law(self, tree, mode, temperature, top_p):
    target, draft = target_and_draft()
    prompt, length, rows = [3, 1, 3], 3, LAW_ROWS
    res = specjax.generate(target, [prompt] * rows, max_new_tokens=length, draft=draft,
                           tree=tree, draft_sample=mode, temperature=temperature,
                           top_p=top_p, seed=4)
    model = target if temperature == 1.0 else tempered(target, temperature)
    conts, probs = exact_continuations(model, prompt, length)
    if top_p < 1.0:  # the exact law under top-p, position by position
      probs = _top_p_law(model, prompt, conts, top_p)
    ok, worst = within_law(res.tokens, probs)
    self.assertTrue(ok, f"worst z={worst}")
    self.assertLess(res.stats["acceptance_rate"], 0.95)  # the draft disagreed
    s = res.stats  # by sibling rank: accepted tries add up, and match their chances
    self.assertEqual(sum(s["sibling_accepted"]), s["accepted"])
    self.assertTrue(all(a >= b for a, b in zip(s["sibling_tried"], s["sibling_tried"][1:])))
    gap = np.abs(np.subtract(s["sibling_accepted"], s["sibling_chance"]))
    self.assertTrue(np.all(gap <= 5 * np.sqrt(s["sibling_chance"]) + 1), s)


def _top_p_law(model, prompt, conts, top_p):
  seqs = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1)
  logits = np.asarray(model.logits(jnp.asarray(seqs)), np.float64)
  probs = np.ones(len(conts))
  for i in range(conts.shape[1]):
    row = logits[:, len(prompt) - 1 + i]
    p = np.exp(row - row.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    order = np.argsort(-p, axis=1)
    sorted_p = np.take_along_axis(p, order, 1)
    keep_sorted = (np.cumsum(sorted_p, 1) - sorted_p) < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, 1)
    p = np.where(keep, p, 0)
    p /= p.sum(axis=1, keepdims=True)
    probs *= p[np.arange(len(conts)), conts[:, i]]
  return probs


class GreedyTest(parameterized.TestCase):

  @parameterized.parameters(((2, 2, 1), "greedy"), ((2, 2, 1), "probabilistic"),
                            ((4, 2, 1, 1), "greedy"), ((3,), "probabilistic"),
                            ([(0,), (1,), (0, 0), (0, 1), (1, 0)], "greedy"))
  def test_equals_target_greedy(self, tree, mode):
    target = tiny_model(vocab=16, n_layers=2, seed=3, sharpness=1.5)
    draft = tiny_model(vocab=16, d_model=16, seed=8, sharpness=1.5)
    res = specjax.generate(target, PROMPTS, max_new_tokens=12, draft=draft, tree=tree,
                           draft_sample=mode)
    for prompt, out in zip(PROMPTS, res.tokens):
      self.assertEqual(out, greedy_oracle(target, prompt, 12))


def _tree_proposal(prompts, temperatures, mode, tree=(3, 2)):
  """One round's tree proposal (node tokens [B, N]) of the sharp tiny pair."""
  target = tiny_model(vocab=16, n_layers=2, seed=3, sharpness=1.5)
  draft = tiny_model(vocab=16, d_model=16, seed=8, sharpness=1.5)
  prep = generation.prepare(target, prompts, max_new_tokens=4, temperature=temperatures,
                            top_k=0, top_p=1.0, eos_id=None, draft=draft, tree=tree,
                            draft_sample=mode)
  state = jax.jit(prep.prefill)(jax.random.PRNGKey(0))
  ys, _, _ = jax.jit(prep.engine.drafter.propose)(
      prep.weights.draft, state.draft_state, state.tokens, state.n, jax.random.PRNGKey(1),
      prep.sampling)
  return np.asarray(ys), prep.engine.drafter.tree


class ChildrenTest(parameterized.TestCase):

  def test_probabilistic_children_at_T0_are_the_distinct_top_k(self):
    """k draws from a point mass would be k copies: at T = 0 the sampled mode takes the
    draft's top-k, like the greedy mode (and stays exact: GreedyTest)."""
    out = {mode: _tree_proposal(PROMPTS, [0.0] * len(PROMPTS), mode)[0]
           for mode in ("probabilistic", "greedy")}
    np.testing.assert_array_equal(out["probabilistic"], out["greedy"])
    for row in out["probabilistic"]:
      self.assertLen(set(row[:3].tolist()), 3)

  def test_sampled_children_are_distinct_and_T0_rows_keep_the_top_k(self):
    """At T > 0 a node's children are draws without replacement: never two alike (i.i.d.
    draws from this sharp draft repeat). T = 0 rows in the same batch still get the top-k."""
    prompts = PROMPTS * 4
    temps = [0.0 if i % 4 == 0 else 1.0 for i in range(len(prompts))]
    out = {"probabilistic": _tree_proposal(prompts, temps, "probabilistic")[0]}
    out["greedy"], tree = _tree_proposal(prompts, [0.0] * len(prompts), "greedy")
    for row in out["probabilistic"]:
      for kids in tree.children:
        kids = kids[kids >= 0]
        self.assertLen(set(row[kids].tolist()), len(kids), row)
    t0 = np.asarray(temps) == 0.0
    np.testing.assert_array_equal(out["probabilistic"][t0], out["greedy"][t0])


class CharTokenizer:
  """One character per token, enough for `constraints.regex`."""
  chars = "abcdefgh0123 ()."
  vocab_size = len(chars)

  def decode(self, ids):
    return "".join(self.chars[i] for i in ids)


PROC_KW = dict(repetition_penalty=[1.3, 2.0, 1.1], no_repeat_ngram_size=[2, 3, 0],
               presence_penalty=0.2, logit_bias={5: 0.5})


class ProcessorTest(parameterized.TestCase):
  """Each node is processed with committed history + its root-to-node path; the committed
  history advances along the accepted path only."""

  def _pair(self):
    return (tiny_model(vocab=16, n_layers=2, seed=3, sharpness=1.5),
            tiny_model(vocab=16, d_model=16, seed=8, sharpness=1.5))

  @parameterized.named_parameters(
      ("penalties_topk_221", (2, 2, 1), "greedy", PROC_KW),
      ("penalties_sampled_paths", [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)],
       "probabilistic", PROC_KW),
      ("regex_topk_421", (4, 2, 1), "greedy", "regex"),
      ("regex_and_penalty_sampled_22", (2, 2), "probabilistic", "regex+rep"),
      ("ngram_penalties_311", (3, 1, 1), "ngram", PROC_KW))
  def test_greedy_equals_target_only(self, tree, mode, kw):
    target, draft = self._pair()
    if isinstance(kw, str):
      automaton = constraints.regex(r"[a-f]+( [0-3a-c]+)*\.?", CharTokenizer())
      kw = dict(constraint=automaton, **(dict(repetition_penalty=1.5) if "rep" in kw else {}))
    ar = specjax.generate(target, PROMPTS, max_new_tokens=12, **kw)
    plain = specjax.generate(target, PROMPTS, max_new_tokens=12)
    self.assertNotEqual(ar.tokens, plain.tokens)  # the processors change the output
    spec = dict(drafter="ngram") if mode == "ngram" else dict(draft=draft, draft_sample=mode)
    res = specjax.generate(target, PROMPTS, max_new_tokens=12, tree=tree, **spec, **kw)
    self.assertEqual(res.tokens, ar.tokens)
    self.assertGreater(res.stats["accepted"], 0)

  def test_committed_history_for_every_node_is_caught(self):
    """The serving-engine bug (every node processed with the committed history only)
    breaks greedy equality on the same inputs."""
    target, draft = self._pair()
    ar = specjax.generate(target, PROMPTS, max_new_tokens=12, **PROC_KW)
    from specjax.verify import layouts
    right = layouts.TreeLayout.prefixes

    def committed_only(self, sampling, history, tokens):
      out = right(self, sampling, history, tokens)
      return jax.tree_util.tree_map(lambda x: jnp.repeat(x[:, :1], x.shape[1], axis=1), out)

    layouts.TreeLayout.prefixes = committed_only
    decode_lib.decode.clear_cache()
    try:
      res = specjax.generate(target, PROMPTS, max_new_tokens=12, draft=draft, tree=(2, 2, 1),
                             draft_sample="greedy", **PROC_KW)
    finally:
      layouts.TreeLayout.prefixes = right
      decode_lib.decode.clear_cache()
    self.assertNotEqual(res.tokens, ar.tokens)

  @parameterized.named_parameters(
      ("sampled_22_rep_ngram", (2, 2), "probabilistic",
       dict(repetition_penalty=2.5, no_repeat_ngram_size=2)),
      ("topk_211_penalties_min_new", (2, 1, 1), "greedy",
       dict(repetition_penalty=2.5, presence_penalty=0.7, frequency_penalty=0.4,
            min_new_tokens=1, logit_bias={2: 1.5})))
  def test_three_token_law(self, tree, mode, kw):
    target, draft = target_and_draft()
    rows, length, temperature = LAW_ROWS, 3, 0.8
    law = exact_law(target, PROC_PROMPT, length, temperature, kw)
    res = specjax.generate(target, [PROC_PROMPT] * rows, max_new_tokens=length, draft=draft,
                           tree=tree, draft_sample=mode, temperature=temperature, seed=6,
                           eos_id=EOS, **kw)
    ok, worst = law_check(law, res.tokens, length)
    self.assertTrue(ok, f"worst z={worst}")
    self.assertGreater(res.stats["rounds"], rows)  # drafts were rejected


def ngram_tree(row, n, tree, vocab=16):
  """The n-gram tree drafter's node tokens for one history row[:n]."""
  tree = trees.Tree.from_branching(tree)
  drafter = tree_drafters.NgramTreeDrafter(vocab_size=vocab, gamma=tree.depth, tree=tree)
  buf = np.zeros((1, 32), np.int32)
  buf[0, :len(row)] = row
  y, q, _ = drafter.propose(None, (), jnp.asarray(buf), jnp.asarray([n]), None, None)
  np.testing.assert_array_equal(q, jax.nn.one_hot(y, vocab))
  return np.asarray(y)[0].tolist()


class NgramTreeTest(parameterized.TestCase):
  """Prompt lookup as a tree: distinct continuations of several earlier matches."""

  def test_distinct_children_from_several_matches(self):
    # "1" occurs after 5, 7, 6 (starts 2, 5, 8): continuations 2 7 1, 3 6 1, 4 0 1;
    # the most recent first, and the leftmost path is the chain's proposal.
    row = [5, 1, 2, 7, 1, 3, 6, 1, 4, 0, 1]
    self.assertEqual(ngram_tree(row, 11, (3, 1, 1)), [4, 3, 2, 0, 6, 7, 1, 1, 1])
    chain = drafters.NgramDrafter(vocab_size=16, gamma=3).propose(
        None, (), jnp.asarray([row + [0] * 21]), jnp.asarray([11]), None, None)[0]
    self.assertEqual(np.asarray(chain)[0].tolist(), [4, 0, 1])
    # A fourth child has no match left: it repeats its parent's token (the root's, 1).
    self.assertEqual(ngram_tree(row, 11, (4, 1, 1))[:4], [4, 3, 2, 1])
    # Matches sharing a first token branch one level down (a trie): 2 then 7 | 6.
    self.assertEqual(ngram_tree([1, 2, 5, 1, 2, 6, 1, 2, 7, 0, 1], 11, (2, 2))[:4],
                     [2, 1, 7, 6])
    # A longer match ranks before a more recent shorter one: "3 1" at start 2 (-> 3 ...)
    # and at start 4 (-> 2 ...), "1" alone nowhere else.
    self.assertEqual(ngram_tree([3, 1, 3, 1, 2, 3, 1], 7, (2, 2, 1)),
                     [2, 3, 3, 2, 1, 3, 1, 2, 2, 3])

  @parameterized.parameters((3, 1, 1), (2, 2, 1), [[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]])
  def test_equals_target_greedy(self, *tree):
    tree = tree[0] if len(tree) == 1 else tree
    target = tiny_model(vocab=16, n_layers=2, seed=3, sharpness=1.5)
    prompts = [[1, 2, 3, 1, 2, 4, 1, 2], [4, 5, 6, 7, 0, 1, 2, 3, 4], [7]]
    res = specjax.generate(target, prompts, max_new_tokens=16, drafter="ngram", tree=tree)
    for prompt, out in zip(prompts, res.tokens):
      self.assertEqual(out, greedy_oracle(target, prompt, 16))
    self.assertGreater(res.stats["accepted"], 0)

  def test_three_token_law_T1(self):
    target, _ = target_and_draft()
    prompt, length, rows = [3, 1, 3, 1, 2, 3, 1], 3, LAW_ROWS
    res = specjax.generate(target, [prompt] * rows, max_new_tokens=length, drafter="ngram",
                           tree=(2, 2, 1), temperature=1.0, seed=4)
    _, probs = exact_continuations(target, prompt, length)
    ok, worst = within_law(res.tokens, probs)
    self.assertTrue(ok, f"worst z={worst}")
    self.assertGreater(res.stats["accepted"], rows // 10)  # the tree's branches were used
    self.assertLess(res.stats["acceptance_rate"], 0.95)


class TreeAttentionTest(parameterized.TestCase):

  def _setup(self):
    target = tiny_model(vocab=16, n_layers=2, seed=3, llama=True, n_heads=4, n_kv_heads=2)
    tree = trees.Tree.from_branching((2, 2))
    prompt = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], np.int32)
    nodes = np.array([[11, 12, 13, 14, 15, 1], [2, 3, 4, 5, 6, 7]], np.int32)
    kv = kv_cache.init_kv(target.config, 2, 32)
    _, kv = model_lib.forward_cached(target.graphdef, target.params, jnp.asarray(prompt[:, :4]),
                                     kv)
    n = jnp.asarray([5, 5])
    chunk = jnp.concatenate([jnp.asarray(prompt[:, 4:]), jnp.asarray(nodes)], axis=1)
    logits, kv = model_lib.forward_cached(target.graphdef, target.params, chunk, kv,
                                          **tree_verify.verify_layout(tree, n))
    return target, tree, prompt, nodes, logits, kv

  def test_every_node_sees_its_path(self):
    target, tree, prompt, nodes, logits, _ = self._setup()
    for b in range(2):
      for i in range(tree.num_nodes):
        path, node = [], i
        while node >= 0:
          path.insert(0, int(nodes[b, node]))
          node = tree.parents[node]
        seq = list(prompt[b]) + path  # zero-padded: one compiled forward (causal)
        full = target.logits(jnp.asarray([seq + [0] * (tree.depth - len(path))]))[0, len(seq) - 1]
        np.testing.assert_allclose(logits[b, i + 1], full, atol=1e-4)

  def test_compaction_equals_a_fresh_prefill(self):
    target, tree, prompt, nodes, _, kv = self._setup()
    path = jnp.asarray([[1, 4], [0, 2]])  # node 1 -> its first child (4); node 0 -> 2
    kv = tree_verify.compact_path(kv, jnp.asarray([4, 4]), path, jnp.asarray([2, 2]))
    committed = np.concatenate([prompt, np.take_along_axis(nodes, np.asarray(path), 1)], 1)
    fresh = kv_cache.init_kv(target.config, 2, 32)
    _, fresh = model_lib.forward_cached(target.graphdef, target.params, jnp.asarray(committed),
                                        fresh)
    for a, b in zip(kv.k + kv.v, fresh.k + fresh.v):
      np.testing.assert_allclose(a[:, :, :7], b[:, :, :7], atol=1e-5)


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("zero_branch", dict(tree=(2, 0)), "branching"),
      ("bad_paths", dict(tree=[(0, 1)]), "parent path"),
      ("rank_without_first", dict(tree=[(1,)]), r"\(1,\) needs its sibling \(0,\)"),
      ("rank_gap", dict(tree=[(0,), (2,)]), r"\(2,\) needs its sibling \(1,\)"),
      ("float_rank", dict(tree=[(0.9,)]), "int child ranks"),
      ("no_drafter", dict(tree=(2, 2), draft=None), "needs a drafter"),
      ("gamma_disagrees", dict(tree=(2, 2), gamma=3), "depth 2"),
      ("lossy_rule", dict(tree=(2, 2), verify_rule="typical"), "exact rule only"),
      ("not_a_tree", dict(tree="wide"), "branching factors"))
  def test_raises(self, kw, message):
    target, draft = target_and_draft()
    kw = dict(dict(draft=draft), **kw)
    with self.assertRaisesRegex(ValueError, message):
      specjax.generate(target, [[1, 2]], max_new_tokens=4, **kw)
