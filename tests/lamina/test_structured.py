"""Structured output (`lamina.sampling.structured`) on SmolLM2 with the local executor:
greedy output under a JSON schema and a regex equals HF `generate` whose logits are
masked by llguidance directly (so what is checked is Lamina's plumbing: the bitmask's
bit order and width, where the mask applies, when a sequence ends); what comes out is
checked by independent validators (`jsonschema`, `re`); constrained and free requests
share a batch without touching each other; sampling with n > 1 forks; a failed step
recovered mid-generation changes no token; bad specifications fail alone by name."""
import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.params import SamplingParams
from lamina.sampling.sampler import mask_rows, sample_rows
from lamina.sampling.structured import Guides, StructuredOutputs, _tokenizer_json
from lamina.sampling.token_rules import bitmask

from .test_engine import engine, run
from .test_recovery import FlakyExecutor

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PROMPT = "Here is a record of one customer, as JSON:"


def _hf_guided(smol, prompt_ids: list[int], spec: StructuredOutputs, max_new: int):
    """HF generate, greedy, each step's logits masked by a fresh llguidance matcher fed
    the tokens generated so far, its mask read as llguidance's torch helpers write it
    (int32 words, token t = bit t & 31 of word t >> 5), not as Lamina reads it (bytes
    through NumPy). Their `apply_token_bitmask_inplace` is not called: it runs under
    `torch.compile`, whose first call in a process took 3-15 s here; its two lines run
    eagerly below."""
    import llguidance
    import llguidance.torch as lt
    from transformers import LogitsProcessor, LogitsProcessorList

    # the tokenizer's JSON as the engine gives it (llguidance.hf passes it unchanged,
    # which transformers 5.17's GGUF tokenizer needs changed: the table test below)
    tok = llguidance.LLTokenizer(_tokenizer_json(smol.tokenizer),
                                 n_vocab=smol.config.vocab_size,
                                 eos_token=smol.tokenizer.eos_token_id)
    matcher = llguidance.LLMatcher(tok, spec.grammar_text())
    n = len(prompt_ids)

    class Mask(LogitsProcessor):
        def __call__(self, input_ids, scores):  # scores: [1, V] fp32
            for t in input_ids[0, n + matcher_seen[0]:].tolist():
                assert matcher.consume_token(t)
                matcher_seen[0] += 1
            bm = lt.allocate_token_bitmask(1, tok.vocab_size)  # [1, W] int32
            lt.fill_next_token_bitmask(matcher, bm, 0)
            token = torch.arange(scores.shape[1])
            allowed = (bm[0, token >> 5] >> (token & 31)) & 1  # [V]
            scores[:, allowed == 0] = float("-inf")
            return scores

    matcher_seen = [0]
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = smol.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new, logits_processor=LogitsProcessorList(
                                      [Mask()]), pad_token_id=smol.tokenizer.eos_token_id)
    return out[0, n:].tolist()


@pytest.mark.parametrize("spec", [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=PHONE)],
                         ids=["json-schema", "regex"])
def test_greedy_structured_output_equals_hf_masked_by_llguidance(smol, smol_packed, spec):
    ids = smol.tokenizer(PROMPT if spec.json else "Call us at")["input_ids"]
    eng = engine(smol, smol_packed, num_kv_slots=512)
    out = run(eng, [ids], SamplingParams(max_tokens=80, temperature=0,
                                         structured_outputs=spec))[0]
    ref = _hf_guided(smol, ids, spec, 80)
    eos = smol.tokenizer.eos_token_id
    # Lamina ends where the structure is complete; HF's mask then allows only EOS
    assert out.finish_reason == "stop" and ref[:len(out.token_ids) + 1] == \
        out.token_ids + [eos], (out.text, smol.tokenizer.decode(ref))
    if spec.json:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    else:
        assert re.fullmatch(PHONE, out.text), out.text
    assert eng.free_slots() == [512]


def test_constrained_and_free_requests_share_a_batch(smol, smol_packed, prompts, hf_greedy):
    """Masks are per row: free requests keep HF's tokens beside constrained ones, and a
    choice, a JSON object and a grammar each hold in the same steps."""
    eng = engine(smol, smol_packed, num_kv_slots=2048)
    free = SamplingParams(max_tokens=24, temperature=0)
    grammar = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    specs = [StructuredOutputs(choice=["Paris", "Lyon", "Marseille"]),
             StructuredOutputs(json_object=True), StructuredOutputs(grammar=grammar)]
    asks = [(prompts[2], free), ("The capital of France is", None), (prompts[5], free),
            ("Give a JSON object:", None), ("What is 6 times 7?", None)]
    ids, k = [], 0
    for p, params in asks:
        if params is None:
            params = SamplingParams(max_tokens=40, temperature=0,
                                    structured_outputs=specs[k])
            k += 1
        ids.append(eng.add_request(p, params))
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    o = [outs[i] for i in ids]
    assert o[0].token_ids == hf_greedy[2][:24] and o[2].token_ids == hf_greedy[5][:24]
    assert o[1].text in ("Paris", "Lyon", "Marseille") and o[1].finish_reason == "stop"
    if o[3].finish_reason == "stop":
        assert isinstance(json.loads(o[3].text), dict)
    else:  # cut by max_tokens: a prefix of JSON, never anything else
        assert o[3].text.startswith("{")
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", o[4].text), o[4].text


def test_sampled_forks_each_follow_the_regex(smol, smol_packed):
    """n = 4 sampled forks from one prefill: each sample has its own matcher."""
    eng = engine(smol, smol_packed, num_kv_slots=512)
    spec = StructuredOutputs(regex=r"[a-z]{3,8}( [a-z]{3,8}){2}")
    out = run(eng, ["Three random words:"], SamplingParams(
        max_tokens=40, temperature=1.0, seed=7, n=4, structured_outputs=spec))[0]
    texts = [c.text for c in out.outputs]
    assert all(re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){2}", t) for t in texts), texts
    assert len(set(texts)) > 1 and all(c.finish_reason == "stop" for c in out.outputs)


def test_recovered_steps_change_no_structured_token(smol, smol_packed):
    """Workers die twice mid-generation (their KV gone: NaN pools): the steps are
    recovered and recomputed; the matchers saw only applied tokens, so the output
    equals a clean run's."""
    spec = StructuredOutputs(json=SCHEMA)
    params = SamplingParams(max_tokens=80, temperature=0, structured_outputs=spec)
    ids = smol.tokenizer(PROMPT)["input_ids"]
    clean = run(engine(smol, smol_packed, num_kv_slots=512), [ids], params)[0]
    pool = KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 512))
    flaky = FlakyExecutor(smol_packed, MemorySide(pool), fail_on={4, 9})
    eng = LLMEngine(EngineConfig(num_kv_slots=512), flaky, smol.tokenizer, smol.config)
    out = run(eng, [ids], params)[0]
    assert out.token_ids == clean.token_ids and flaky.recovered == 2


@pytest.mark.parametrize("spec, match", [
    (dict(regex="a(b"), "StructuredOutputs.regex: .*unclosed group"),
    (dict(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
     "StructuredOutputs.json: "),
    (dict(grammar="start: foo"), "StructuredOutputs.grammar: "),
])
def test_bad_specification_fails_alone_and_changes_nothing(smol, smol_packed, spec, match):
    eng = engine(smol, smol_packed, num_kv_slots=512)
    with pytest.raises(ValueError, match=match):
        eng.add_request("Hi", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert not eng.has_unfinished() and eng.free_slots() == [512] and not eng._reqs


def test_a_grammar_is_checked_once_and_the_kept_ones_are_bounded(smol, monkeypatch):
    """The server's check and the engine's add share one compile; a different spec (or
    the same schema with flexible whitespace) compiles anew; at most CHECKED are kept."""
    from lamina.sampling import structured

    guides = structured.Guides(smol.tokenizer, smol.config.vocab_size)
    compiled = []
    real = StructuredOutputs.grammar_text
    monkeypatch.setattr(StructuredOutputs, "grammar_text",
                        lambda self: compiled.append(self) or real(self))
    a = StructuredOutputs(json=SCHEMA)
    assert guides.check(a) == guides.check(StructuredOutputs(json=dict(SCHEMA)))
    guides.check(StructuredOutputs(json=SCHEMA, whitespace_flexible=True))
    assert len(compiled) == 2
    monkeypatch.setattr(structured, "CHECKED", 3)
    for k in range(5):
        guides.check(StructuredOutputs(regex=f"a{{{k + 1}}}"))
    assert len(guides._checked) == 3 and len(compiled) == 7
    guides.check(StructuredOutputs(regex="a{5}"))  # among the kept: no compile
    assert len(compiled) == 7


# the decoder transformers 5.17 gives SmolLM2's GGUF tokenizer (5.23+: ByteLevel alone)
WRAPPED_DECODER = {"type": "Sequence", "decoders": [
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}


def test_llguidance_reads_a_byte_level_vocabulary_whatever_decoder_wraps_it(smol):
    """Every token's bytes in the engine's llguidance table equal HF's decoding of that
    token alone (where it decodes to whole characters), with the model's tokenizer and
    with the same vocabulary under transformers 5.17's decoder. With that decoder
    llguidance's own `hf.from_tokenizer` reads "Ġ" as its UTF-8 bytes, which refused
    every token with a space on the H200 machine's transformers."""
    import llguidance.hf
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(smol.tokenizer.backend_tokenizer.to_str())
    spec["decoder"] = WRAPPED_DECODER
    wrapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                      eos_token=smol.tokenizer.eos_token)
    n = len(smol.tokenizer)
    special = set(smol.tokenizer.all_special_ids)
    text = smol.tokenizer.batch_decode([[i] for i in range(n)])
    whole = [i for i in range(n) if "\ufffd" not in text[i] and i not in special]
    assert len(whole) > 40000
    space = smol.tokenizer.encode(" answer")[0]
    assert llguidance.hf.from_tokenizer(wrapped, n).decode_bytes([space]) == b"\xc4\xa0answer"
    for tok in (smol.tokenizer, wrapped):
        guides = Guides(tok, smol.config.vocab_size)
        ll = guides._ll_tokenizer()
        assert [ll.decode_bytes([i]) for i in whole] == [text[i].encode() for i in whole]
        guide = guides.guide(guides.check(StructuredOutputs(regex="The answer is [0-9]+")))
        assert all(guide.accept(t) for t in tok.encode("The answer is 42")), guide.error()
@pytest.mark.parametrize("kw, match", [
    (dict(), "exactly one of json, json_object, regex, choice, grammar; got none"),
    (dict(regex="a", choice=["b"]), "got regex, choice"),
    (dict(json="{not json"), "json is not valid JSON"),
    (dict(json=[1]), "must be a JSON schema"),
    (dict(choice="ab"), "choice must be a list of non-empty strings"),
    (dict(choice=["a", ""]), "choice must be a list"),
    (dict(regex=""), "regex must be a non-empty string"),
])
def test_specification_checked_on_creation(kw, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputs(**kw)


def test_sampling_params_take_a_dict_and_name_a_bad_one():
    p = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert p.structured_outputs == StructuredOutputs(choice=("x", "y"))
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs: .*'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_mask_rows_read_llguidance_bit_order():
    """Bit t & 7 of byte t >> 3 is token t (little-endian int32 words, as llguidance
    fills them), per row; tokens past the mask's width are left out; a row with no
    token allowed is refused."""
    V = 70
    allowed = [[0, 9, 31, 32, 63, 64], [1, 62]]
    words = np.zeros((2, 2), dtype=np.int32)  # covers tokens 0..63 only
    for m, toks in enumerate(allowed):
        for t in toks:
            if t < 64:
                words[m, t >> 5] |= np.uint32(1 << (t & 31)).view(np.int32)
    rows = torch.arange(2 * V, dtype=torch.float32).reshape(2, V)
    out = mask_rows(rows, [words[0].tobytes(), words[1].tobytes()])
    assert [torch.isfinite(r).nonzero().flatten().tolist() for r in out] == \
        [[0, 9, 31, 32, 63], [1, 62]]
    assert torch.equal(out[1, [1, 62]], rows[1, [1, 62]])
    assert rows.isfinite().all()  # a copy: the logits stay for logprobs
    with pytest.raises(ValueError, match="no token .* may come next .row 1."):
        mask_rows(rows, [words[0].tobytes(), bytes(8)])


def test_masked_rows_draw_only_allowed_tokens_with_penalties_and_bias():
    """Greedy and sampled rows, with and without penalties and a logit_bias pushing a
    masked token to the top: every drawn token is an allowed one, and an unmasked row
    in the same call draws what it draws alone."""
    torch.manual_seed(0)
    V = 300
    logits = torch.randn(4, V)
    ok = [5, 17, 200]
    word = np.zeros((V + 31) // 32, dtype=np.int32)
    for t in ok:
        word[t >> 5] |= np.uint32(1 << (t & 31)).view(np.int32)
    mask = word.tobytes()
    top = int(torch.argmax(logits[0]))
    ps = [SamplingParams(temperature=0, logit_bias={top: 100}),
          SamplingParams(temperature=1.0, presence_penalty=1.0),
          SamplingParams(temperature=0, repetition_penalty=1.3),
          SamplingParams(temperature=0.8, top_k=50)]
    hist = [((), 0), ((5, 5, 17), 1), ((5, 200), 1), ((), 0)]
    out = sample_rows(logits, ps, [(1,), (2, 3, 4), (5,), (6,)], [3] * 4, hist,
                      [mask, mask, mask, b""])
    assert all(t in ok for row in out[:3] for t in row), out
    alone = sample_rows(logits[3:], ps[3:], [(6,)], [3], None)
    assert out[3] == alone[0]
    want = int(torch.argmax(torch.where(torch.isin(torch.arange(V), torch.tensor(ok)),
                                        logits[0], float("-inf"))))
    assert out[0] == (want,)  # the bias on a masked token changes nothing


def test_masks_of_two_widths_in_one_call_each_read_as_alone():
    """llguidance writes 32-bit words (40 bytes for 300 tokens), `token_rules.bitmask`
    bytes (38): rows of both widths in one call, greedy and drawn, each draw among its
    own allowed tokens and as it draws alone (read as one [rows, width] array, the
    second row's mask shifted by the first's extra bytes)."""
    V = 300
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    ok = [[5, 17, 200, 299], [3, 64, 250], [5, 17, 200, 299], [3, 64, 250]]
    word = np.zeros((2, (V + 31) // 32), dtype=np.int32)
    for t in ok[0]:
        word[0, t >> 5] |= np.uint32(1 << (t & 31)).view(np.int32)
    masks = [word[0].tobytes(), bitmask(ok[1], V)] * 2
    assert [len(m) for m in masks] == [40, 38, 40, 38]
    ps = [SamplingParams(temperature=0)] * 2 + [SamplingParams(temperature=1.0)] * 2
    seeds = [(1,), (2,), (3, 4, 5), (6, 7, 8)]
    out = sample_rows(logits, ps, seeds, [9] * 4, masks=masks)
    alone = [sample_rows(logits[r:r + 1], ps[r:r + 1], seeds[r:r + 1], [9],
                         masks=masks[r:r + 1])[0] for r in range(4)]
    assert out == alone
    assert all(set(row) <= set(ok[r]) for r, row in enumerate(out)), out


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_structured_request_beside_allowed_token_ids_each_as_alone(smol, smol_packed,
                                                                     temperature):
    """A JSON request (its masks llguidance's, in words) and one with allowed_token_ids
    (masks from `bitmask`) draw in the same steps, greedy and sampled: each answers as
    it does alone, the second among its tokens only. Found by a random workload (the
    second's draws read a mask shifted by two bytes and left its set)."""
    allowed = [13, 28, 30, 253, 260, 282, 1463, 1910, 2824]
    both = [(PROMPT, SamplingParams(max_tokens=16, temperature=temperature, seed=1,
                                    structured_outputs=StructuredOutputs(json=SCHEMA))),
            ("The history of printing in Europe", SamplingParams(
                max_tokens=8, temperature=temperature, seed=2, allowed_token_ids=allowed))]
    eng = engine(smol, smol_packed, num_kv_slots=2048)
    ids = [eng.add_request(p, sp) for p, sp in both]
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    alone = [run(engine(smol, smol_packed, num_kv_slots=2048), [p], sp)[0] for p, sp in both]
    assert [outs[i].token_ids for i in ids] == [a.token_ids for a in alone]
    assert set(alone[1].token_ids) <= set(allowed) and len(alone[1].token_ids) == 8


def test_a_tokenizer_without_rust_tables_is_named():
    class SlowTokenizer:  # a Python-only tokenizer: llguidance reads the Rust one's JSON
        eos_token_id = 0

        def __len__(self):
            return 100

    with pytest.raises(ValueError, match="needs a fast .Rust-backed. tokenizer; this "
                                         "model's is a SlowTokenizer"):
        Guides(SlowTokenizer(), 100).check(StructuredOutputs(regex="a"))
