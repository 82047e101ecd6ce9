"""phaseloop's ``GenerationTesterMixin``, written to the contract of transformers' own
(``tests/generation/test_utils.py`` in its repository; its sdist does not carry it, see
fetch.py). The stand-in ``generation/test_utils.py`` that fetch.py writes re-exports this
class, so ``ModelTesterMixin.test_generation_tester_mixin_inheritance`` checks it too.

A mixin for the tester classes of tests/test_hf_common.py: it reads
``self.model_tester.prepare_config_and_inputs_for_common()`` and runs every class of
``self.all_generative_model_classes``, with transformers' settings (the first 2 rows of the
tester's batch, 3 new tokens, its logits processors: bad words, repetition penalty, top-k /
top-p / temperature when sampling). Where transformers checks only shapes, this also checks
values against the model's own forward pass:

* greedy and sampling (plain, ``return_dict_in_generate`` with ``output_scores`` /
  ``output_logits``, with and without the cache): lengths and shapes; each step's logits
  equal ``forward`` on the sequence so far (atol ``ATOL``); greedy picks the argmax of its
  scores, sampling a token its warpers allow; the same seed samples the same tokens;
* beam search and beam sampling (``num_return_sequences`` 2, dict output:
  ``sequences_scores``, ``beam_indices``), beam search with the cache equals without, and
  the cache reordered between beams continues the chosen beams (``reorder_cache``);
* ``use_cache=True`` equals ``use_cache=False`` token for token (greedy, left padding too);
* continuing from the returned cache equals one call (with and without a mask, and from
  ``inputs_embeds``);
* left padding: a left-padded row's next-token logits equal the row alone (atol ``ATOL``,
  transformers' 1e-5), and greedy on a batch of rows padded differently equals each row alone;
* ``inputs_embeds`` (with and without ``input_ids``) equals generating from the ids; other
  vectors change the logits;
* ``logits_to_keep``; ``max_new_tokens`` / ``max_length`` / ``min_new_tokens``; EOS stops
  a row and pads it; no ``input_ids`` starts from ``bos_token_id``;
* refused clearly: ``output_attentions`` / ``output_hidden_states`` in generate (issue 31
  item 2), ``cache_implementation`` (static, offloaded: the cache is the model's own),
  assisted and prompt-lookup decoding for a stateful model (transformers' own refusal,
  checked here; the "equals greedy" comparison runs for a model that is not stateful),
  ``low_memory`` beam search (refused by transformers 5.x for every model).
"""

from __future__ import annotations

import torch
from transformers.generation import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

ATOL = 1e-5  # transformers' tolerance for logits that must agree (fp32)


class GenerationTesterMixin:
    model_tester = None
    all_generative_model_classes = ()
    input_name = "input_ids"
    max_new_tokens = 3

    # ------------------------------------------------------------------ helpers
    def prepare_config_and_inputs_for_generate(self, batch_size=2):
        """The tester's inputs, first ``batch_size`` rows, no labels; EOS off (lengths fixed)."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        inputs = {k: v[:batch_size] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
                  if k not in ("labels", "use_cache")}
        config.eos_token_id = None
        return config, inputs

    def _models(self):
        """(model in eval mode, its generate inputs) for each generative class, its weights
        moved off their initialisation (+ N(0, 0.05), as tests/test_hf.py does): at
        phaseloop's init a tiny UT's next-token logits move by under 1e-5 when the history
        changes, so no comparison at ATOL could see a wrong cache or padding there."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            torch.manual_seed(0)
            model = model_class(config).eval()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            yield model, inputs

    @staticmethod
    def _processors(do_sample=False):
        kw = {"bad_words_ids": [[1, 0]], "repetition_penalty": 1.2, "remove_invalid_values": True}
        return {**kw, "top_k": 10, "top_p": 0.7, "temperature": 0.7} if do_sample else kw

    def _generate(self, model, inputs, **kw):
        kw.setdefault("max_new_tokens", self.max_new_tokens)
        with torch.no_grad():
            return model.generate(**inputs, **kw)

    def _next_logits(self, model, ids, mask=None):
        with torch.no_grad():
            return model(ids, attention_mask=mask, use_cache=False).logits[:, -1]

    def _check_outputs(self, out, model, inputs, rows, beams=1, use_cache=True):
        """transformers' ``_check_generate_outputs``: the output class, sequence length,
        one scores / logits entry per new token of the right shape, the cache when asked
        for, no attentions or hidden states."""
        T, n = inputs["input_ids"].shape[1], self.max_new_tokens
        cls = GenerateBeamDecoderOnlyOutput if beams > 1 else GenerateDecoderOnlyOutput
        self.assertIsInstance(out, cls)
        self.assertEqual(tuple(out.sequences.shape), (rows, T + n))
        width = inputs["input_ids"].shape[0] * beams if beams > 1 else rows  # beams: every beam's row
        for name in ("scores", "logits"):
            steps = getattr(out, name)
            self.assertEqual(len(steps), n, name)
            for s in steps:
                self.assertEqual(tuple(s.shape), (width, model.config.vocab_size), name)
        self.assertIsNone(out.attentions)
        self.assertIsNone(out.hidden_states)
        self.assertEqual(out.cache is not None, use_cache)
        if use_cache:  # every column but the last token has been through the model
            self.assertEqual(out.cache.get_seq_length(), T + n - 1)

    def _check_step_logits(self, model, out, mask):
        """Each step's raw logits equal forward on the sequence so far (greedy, sampling)."""
        T = out.sequences.shape[1] - len(out.logits)
        for i, step in enumerate(out.logits):
            m = None if mask is None else torch.cat([mask, mask.new_ones(mask.shape[0], i)], 1)
            torch.testing.assert_close(step, self._next_logits(model, out.sequences[:, :T + i], m),
                                       atol=ATOL, rtol=0)

    # ------------------------------------------------------------------ greedy
    def test_greedy_generate(self):
        for model, inputs in self._models():
            out = self._generate(model, inputs, do_sample=False, **self._processors())
            T = inputs["input_ids"].shape[1]
            self.assertEqual(tuple(out.shape), (2, T + self.max_new_tokens))
            self.assertTrue(torch.equal(out[:, :T], inputs["input_ids"]))

    def _greedy_dict(self, use_cache):
        for model, inputs in self._models():
            out = self._generate(model, inputs, do_sample=False, output_scores=True, output_logits=True,
                                 return_dict_in_generate=True, use_cache=use_cache, **self._processors())
            self._check_outputs(out, model, inputs, rows=2, use_cache=use_cache)
            self._check_step_logits(model, out, inputs.get("attention_mask"))
            T = inputs["input_ids"].shape[1]
            picked = torch.stack([s.argmax(-1) for s in out.scores], 1)
            self.assertTrue(torch.equal(picked, out.sequences[:, T:]))

    def test_greedy_generate_dict_outputs(self):
        self._greedy_dict(use_cache=False)

    def test_greedy_generate_dict_outputs_use_cache(self):
        self._greedy_dict(use_cache=True)

    def test_greedy_use_cache_equals_no_cache(self):
        """Exact tokens, on the tester's batch and on a left-padded one."""
        for model, inputs in self._models():
            padded = {**inputs, "attention_mask": inputs["attention_mask"].clone()}
            padded["attention_mask"][0, :3] = 0
            for x in (inputs, padded):
                a = self._generate(model, x, do_sample=False, max_new_tokens=5, use_cache=True)
                b = self._generate(model, x, do_sample=False, max_new_tokens=5, use_cache=False)
                self.assertTrue(torch.equal(a, b), (a, b))

    # ------------------------------------------------------------------ sampling
    def _sample(self, model, inputs, n, **kw):
        torch.manual_seed(0)
        return self._generate(model, inputs, do_sample=True, num_beams=1, num_return_sequences=n,
                              **self._processors(do_sample=True), **kw)

    def test_sample_generate(self):
        for model, inputs in self._models():
            for n in (1, 2):
                out = self._sample(model, inputs, n)
                self.assertEqual(tuple(out.shape), (2 * n, inputs["input_ids"].shape[1] + self.max_new_tokens))
                self.assertTrue(torch.equal(out, self._sample(model, inputs, n)))  # same seed, same tokens

    def test_sample_generate_dict_output(self):
        for model, inputs in self._models():
            for use_cache in (True, False):
                out = self._sample(model, inputs, 2, output_scores=True, output_logits=True,
                                   return_dict_in_generate=True, use_cache=use_cache)
                self._check_outputs(out, model, inputs, rows=4, use_cache=use_cache)
                rep = {k: v.repeat_interleave(2, 0) for k, v in inputs.items()}
                self._check_step_logits(model, out, rep.get("attention_mask"))
                T = inputs["input_ids"].shape[1]
                for i, s in enumerate(out.scores):  # each token is one the warpers kept
                    kept = s.gather(1, out.sequences[:, T + i:T + i + 1])
                    self.assertTrue(torch.isfinite(kept).all())

    # ------------------------------------------------------------------ beam search
    def _beam(self, model, inputs, do_sample=False, **kw):
        torch.manual_seed(0)
        return self._generate(model, inputs, do_sample=do_sample, num_beams=2, num_return_sequences=2,
                              early_stopping=False, length_penalty=2.0, **self._processors(do_sample), **kw)

    def test_beam_search_generate(self):
        for model, inputs in self._models():
            a = self._beam(model, inputs, use_cache=True)
            self.assertEqual(tuple(a.shape), (4, inputs["input_ids"].shape[1] + self.max_new_tokens))
            self.assertTrue(torch.equal(a, self._beam(model, inputs, use_cache=False)))

    def _beam_dict(self, use_cache, do_sample=False):
        for model, inputs in self._models():
            out = self._beam(model, inputs, do_sample, output_scores=True, output_logits=True,
                             return_dict_in_generate=True, use_cache=use_cache)
            self._check_outputs(out, model, inputs, rows=4, beams=2, use_cache=use_cache)
            self.assertEqual(tuple(out.sequences_scores.shape), (4,))
            self.assertEqual(tuple(out.beam_indices.shape[:1]), (4,))
            self.assertTrue(((out.beam_indices == -1) | (out.beam_indices // 2 == torch.arange(4)[:, None] // 2)).all())

    def test_beam_search_generate_dict_output(self):
        self._beam_dict(use_cache=False)

    def test_beam_search_generate_dict_outputs_use_cache(self):
        self._beam_dict(use_cache=True)

    def test_beam_sample_generate(self):
        for model, inputs in self._models():
            out = self._beam(model, inputs, do_sample=True)
            self.assertEqual(tuple(out.shape), (4, inputs["input_ids"].shape[1] + self.max_new_tokens))
            self.assertTrue(torch.equal(out, self._beam(model, inputs, do_sample=True)))
        self._beam_dict(use_cache=True, do_sample=True)

    def test_beam_search_reorders_cache(self):
        """Beam search reorders the cache (``cache.reorder_cache(beam_idx)``): (row r continues row
        beam_idx[r]; a beam stays in its prompt's rows, so in its padding group), the next
        token's logits equal forward on the chosen rows' sequences (atol ATOL). Tiny untrained
        models rarely swap beams in 3 tokens, so generate alone would not show a wrong order."""
        for model, inputs in self._models():
            ids = inputs["input_ids"].repeat_interleave(2, 0)  # 2 prompts x 2 beams
            ids[1::2, -1] = (ids[1::2, -1] + 1) % model.config.vocab_size  # beams differ
            mask = torch.ones_like(ids)
            mask[2:, :2] = 0  # the second prompt left-padded: its beams are another group
            with torch.no_grad():
                out = model(ids, attention_mask=mask, use_cache=True)
                beam_idx = torch.tensor([1, 1, 3, 2])
                out.cache.reorder_cache(beam_idx)
                nxt = torch.tensor([[3], [4], [5], [6]])
                got = model(nxt, attention_mask=torch.cat([mask, mask.new_ones(4, 1)], 1),
                            cache=out.cache, use_cache=True).logits[:, -1]
            want = self._next_logits(model, torch.cat([ids[beam_idx], nxt], 1),
                                     torch.cat([mask, mask.new_ones(4, 1)], 1))
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)

    def test_beam_search_low_memory_refused(self):
        """transformers 5.x refuses low_memory beam search for every model: an error, not ignored."""
        for model, inputs in self._models():
            with self.assertRaisesRegex(ValueError, "low_memory"):
                self._beam(model, inputs, low_memory=True)

    # ------------------------------------------------------------------ the cache
    def test_generate_continue_from_past_key_values(self):
        """generate(k) then generate from its sequences and cache (k more) equals generate(2k),
        with the tester's mask and without one."""
        for model, inputs in self._models():
            for x in (inputs, {"input_ids": inputs["input_ids"]}):
                whole = self._generate(model, x, do_sample=False, max_new_tokens=4)
                first = self._generate(model, x, do_sample=False, max_new_tokens=2, return_dict_in_generate=True)
                more = {"input_ids": first.sequences}
                if "attention_mask" in x:
                    more["attention_mask"] = torch.cat([x["attention_mask"], x["attention_mask"].new_ones(2, 2)], 1)
                out = self._generate(model, more, do_sample=False, max_new_tokens=2, cache=first.cache)
                self.assertTrue(torch.equal(out, whole), (out, whole))

    def test_generate_continue_from_inputs_embeds(self):
        """From inputs_embeds: generate(3), then the prompt's and the new tokens' vectors with the
        returned cache, one more token: the fourth token of generate(4)."""
        for model, inputs in self._models():
            e = model.get_input_embeddings()(inputs["input_ids"]).detach()
            whole = self._generate(model, {"inputs_embeds": e}, do_sample=False, max_new_tokens=4)
            first = self._generate(model, {"inputs_embeds": e}, do_sample=False, max_new_tokens=3,
                                   return_dict_in_generate=True)
            more = torch.cat([e, model.get_input_embeddings()(first.sequences).detach()], 1)
            out = self._generate(model, {"inputs_embeds": more}, do_sample=False, max_new_tokens=1,
                                 cache=first.cache)
            self.assertTrue(torch.equal(torch.cat([first.sequences, out], 1), whole))

    def test_past_key_values_format(self):
        """The returned cache is the model's own (``PhaseloopCache``: one KVCache per left-padding
        length, docs/hf.md), not a layer-indexed transformers Cache: it has consumed every
        column but the last token, one group per padding length, and beam search can reorder it."""
        for model, inputs in self._models():
            mask = inputs["attention_mask"].clone()
            mask[1, :2] = 0
            out = self._generate(model, {**inputs, "attention_mask": mask}, do_sample=False,
                                 return_dict_in_generate=True)
            T = inputs["input_ids"].shape[1]
            self.assertEqual(out.cache.get_seq_length(), T + self.max_new_tokens - 1)
            self.assertEqual(sorted(out.cache.groups), [0, 2])
            self.assertTrue(callable(getattr(out.cache, "reorder_cache", None)))

    # ------------------------------------------------------------------ left padding
    def test_left_padding_compatibility(self):
        """A left-padded row's next-token logits equal the row alone (atol ATOL): 8 pad columns
        before every row (transformers' check), and rows padded differently (the first 3 and 0
        tokens of the rows replaced by padding); greedy on the latter equals each row alone,
        token for token."""
        for model, inputs in self._models():
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            padded = torch.cat([ids.new_zeros(2, 8), ids], 1)
            pmask = torch.cat([mask.new_zeros(2, 8), mask], 1)
            torch.testing.assert_close(self._next_logits(model, padded, pmask), self._next_logits(model, ids, mask),
                                       atol=ATOL, rtol=0)
            mixed, mmask = ids.clone(), mask.clone()
            mixed[0, :3], mmask[0, :3] = 0, 0
            rows = (ids[0:1, 3:], ids[1:2])
            alone = torch.cat([self._next_logits(model, r) for r in rows])
            torch.testing.assert_close(self._next_logits(model, mixed, mmask), alone, atol=ATOL, rtol=0)
            gen = self._generate(model, {"input_ids": mixed, "attention_mask": mmask}, do_sample=False)
            for b, r in enumerate(rows):
                one = self._generate(model, {"input_ids": r}, do_sample=False)
                self.assertTrue(torch.equal(gen[b, -one.shape[1]:], one[0]))

    # ------------------------------------------------------------------ inputs
    def test_generate_from_inputs_embeds(self):
        """The ids' own vectors as inputs_embeds (with input_ids too, or alone) generate what the
        ids do, with and without the cache; other vectors change the logits."""
        for model, inputs in self._models():
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            e = model.get_input_embeddings()(ids).detach()
            kw = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)
            for use_cache in (True, False):
                want = self._generate(model, inputs, use_cache=use_cache, **kw)
                both = self._generate(model, {**inputs, "inputs_embeds": e}, use_cache=use_cache, **kw)
                self.assertTrue(torch.equal(both.sequences, want.sequences))
                alone = self._generate(model, {"inputs_embeds": e, "attention_mask": mask}, use_cache=use_cache, **kw)
                self.assertTrue(torch.equal(alone.sequences, want.sequences[:, ids.shape[1]:]))
                torch.testing.assert_close(alone.logits, want.logits, atol=ATOL, rtol=0)
            other = self._generate(model, {**inputs, "inputs_embeds": torch.randn_like(e)}, **kw)
            self.assertFalse(torch.allclose(other.logits[0], want.logits[0], atol=ATOL))

    def test_generate_without_input_ids(self):
        """No prompt: generation starts from bos_token_id (None by default: phaseloop models
        train on raw text, so it is set here), as if given that one token."""
        for model, _ in self._models():
            model.generation_config.bos_token_id = model.config.bos_token_id = 5
            out = self._generate(model, {}, do_sample=False)
            self.assertEqual(tuple(out.shape), (1, 1 + self.max_new_tokens))
            self.assertTrue(torch.equal(out, self._generate(model, {"input_ids": torch.tensor([[5]])},
                                                            do_sample=False)))

    def test_generate_methods_with_logits_to_keep(self):
        """forward keeps the last k logits (or the columns of an index tensor); generate gives the
        same tokens whatever logits_to_keep it is handed."""
        for model, inputs in self._models():
            self.assertTrue(model._supports_logits_to_keep())
            with torch.no_grad():
                full = model(**inputs, use_cache=False).logits
                self.assertTrue(torch.equal(model(**inputs, use_cache=False, logits_to_keep=2).logits, full[:, -2:]))
                idx = torch.tensor([0, 4])
                self.assertTrue(torch.equal(model(**inputs, use_cache=False, logits_to_keep=idx).logits, full[:, idx]))
            want = self._generate(model, inputs, do_sample=False)
            for k in (0, 1):
                self.assertTrue(torch.equal(self._generate(model, inputs, do_sample=False, logits_to_keep=k), want))

    def test_prepare_inputs_for_generation_kwargs_forwards(self):
        """Keyword arguments that prepare_inputs_for_generation does not know go on to forward."""
        for model, inputs in self._models():
            out = model.prepare_inputs_for_generation(inputs["input_ids"], foo="bar")
            self.assertEqual(out["foo"], "bar")

    # ------------------------------------------------------------------ lengths and EOS
    def test_max_min_new_tokens_and_eos(self):
        """max_new_tokens / max_length fix the length; EOS stops a row (the rest padded, the rows
        equal the free run up to their EOS); min_new_tokens forbids EOS before that many tokens
        (the first token is then the best other than EOS)."""
        for model, inputs in self._models():
            T = inputs["input_ids"].shape[1]
            free = self._generate(model, inputs, do_sample=False, max_new_tokens=6)
            self.assertEqual(free.shape[1], T + 6)
            self.assertTrue(torch.equal(self._generate(model, inputs, do_sample=False, max_new_tokens=None,
                                                       max_length=T + 6), free))
            eos, pad = int(free[0, T + 1]), 0
            out = self._generate(model, inputs, do_sample=False, max_new_tokens=6, eos_token_id=eos, pad_token_id=pad)
            for b in range(2):
                hit = (free[b, T:] == eos).nonzero()
                k = int(hit[0]) if len(hit) else 6
                self.assertTrue(torch.equal(out[b, :T + k + 1], free[b, :T + k + 1]))
                self.assertTrue((out[b, T + k + 1:] == pad).all())
            first = int(free[0, T])
            out = self._generate(model, inputs, do_sample=False, max_new_tokens=4, min_new_tokens=3,
                                 eos_token_id=first, pad_token_id=pad)
            self.assertFalse((out[:, T:T + 3] == first).any())
            logits = self._next_logits(model, inputs["input_ids"], inputs["attention_mask"])
            logits[:, first] = -float("inf")
            self.assertTrue(torch.equal(out[:, T], logits.argmax(-1)))

    # ------------------------------------------------------------------ refused
    def test_generate_refuses_attentions_and_hidden_states(self):
        """output_attentions / output_hidden_states in generate are refused by the model with
        its reason (issue 31 item 2), never answered with None."""
        from phaseloop.errors import ConfigError

        for model, inputs in self._models():
            for name in ("output_attentions", "output_hidden_states"):
                with self.assertRaisesRegex(ConfigError, f"{name} is not supported"):
                    self._generate(model, inputs, do_sample=False, return_dict_in_generate=True, **{name: True})

    def test_generate_with_static_cache(self):
        """transformers' static / offloaded caches (and so its compiled generate) do not apply to
        the model's own cache: ``cache_implementation`` is refused with the reason, not ignored."""
        from phaseloop.errors import ConfigError

        for model, inputs in self._models():
            for impl in ("static", "offloaded"):
                with self.assertRaisesRegex(ConfigError, f"cache_implementation='{impl}' is not supported"):
                    self._generate(model, inputs, do_sample=False, cache_implementation=impl)

    @staticmethod
    def _candidates(model):
        """Assisted decoding (the model as its own assistant) and prompt lookup."""
        return ({"assistant_model": model}, {"prompt_lookup_num_tokens": 2})

    def test_assisted_decoding_refused_for_stateful_models(self):
        """Both are refused for a stateful model, with the reason (the model's own check: transformers
        5.25 dropped its stateful refusal and would fail inside assisted decoding instead)."""
        from phaseloop.errors import ConfigError

        for model, inputs in self._models():
            if not model._is_stateful:
                self.skipTest(f"{type(model).__name__} is not stateful: assisted decoding runs "
                              "(test_assisted_decoding_matches_greedy_search)")
            for extra in self._candidates(model):
                with self.assertRaisesRegex(ConfigError, "assisted generation .* is not supported by "
                                            "PhaseloopForCausalLM: its cache cannot be cropped"):
                    self._generate(model, inputs, do_sample=False, **extra)

    def _matches_greedy(self, which):
        for model, inputs in self._models():
            if model._is_stateful:
                self.skipTest(f"{type(model).__name__} is stateful: its cache cannot be cropped back to the "
                              "accepted tokens (PhaseloopCache has no crop: one KVCache per padding length, "
                              "and under UT+ACT the halted positions' step inputs), so it refuses "
                              "assisted and prompt-lookup decoding "
                              "(test_assisted_decoding_refused_for_stateful_models)")
            want = self._generate(model, inputs, do_sample=False, max_new_tokens=5)
            got = self._generate(model, inputs, do_sample=False, max_new_tokens=5, **self._candidates(model)[which])
            self.assertTrue(torch.equal(got, want))

    def test_assisted_decoding_matches_greedy_search(self):
        self._matches_greedy(0)

    def test_prompt_lookup_decoding_matches_greedy_search(self):
        self._matches_greedy(1)
