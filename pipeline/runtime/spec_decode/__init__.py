"""Speculative decoding for the torch runtime: a cheap proposer drafts a few tokens per decoding request and
the target model checks them all in one forward pass.

Where each part lives:
- drafting (this package): `proposer.NgramProposer` (prompt lookup) and `draft_model.DraftModelProposer`
  (a smaller engine); `adaptive.AdaptiveDraftLength` sizes each request's draft; `factory.make_proposer`
  reads the engine directory's speculative settings. `LLMEngine.step` calls `propose` before `schedule()`;
  drafts are plain ints on `request.draft_token_ids`.
- budgeting and KV: the scheduler gives drafts the token budget no decode needs and caps them at the
  request's length limit; the block manager allocates their slots and, after the step, trims the blocks
  of rejected drafts (`BlockManager.trim`).
- verification: `ModelRunner.execute` computes the target's token at every draft position in the same
  forward, and `sampler.accept_drafts` keeps drafts while they equal those tokens, then adds the target's
  own next token. `metrics.spec_decode_stats` turns the per-request counters into acceptance figures.

NOTE: why there is no separate rejection sampler (`verifier.py`). The standard rule (accept draft d with
probability min(1, p(d) / q(d)), else resample from max(p - q, 0)) keeps the target's distribution but
not its samples. Here each position's token is drawn exactly as without speculation (the sampler keys its
uniform by seed and output index), and a draft is accepted iff it equals that token. For a deterministic
draft (prompt lookup, greedy draft model) this IS the rejection rule with a one-hot q; for a sampled draft
it accepts with probability P(draft == target draw) instead of sum(min(p, q)), the price of outputs that
are token-for-token identical with speculation on or off, greedy or seeded. The draft-model proposer
narrows that gap by drawing its tokens with the target's keyed uniform (see draft_model.py). So the
verifier is `accept_drafts(target_tokens, draft_ids) -> accepted_ids`, a pure function in sampler.py.
"""
