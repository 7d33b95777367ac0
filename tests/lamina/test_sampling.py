"""Sampler distributions vs a NumPy reference on fixed logits; seeded reproducibility."""
import numpy as np
import pytest
import torch

from lamina.sampling.params import SamplingParams
from lamina.sampling.sampler import (
    apply_penalties,
    draw_seed,
    prompt_logprobs,
    row_logprobs,
    sample,
    sample_rows,
    sampling_probs,
)

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.4, -1.0, 3.0, 0.0, -0.2])


def numpy_probs(logits, temperature, top_k, top_p):
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < len(x):
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep, mass = [], 0.0
        for i in order:  # smallest set of most likely tokens whose mass reaches top_p
            keep.append(i)
            mass += p[i]
            if mass >= top_p:
                break
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


@pytest.mark.parametrize("t,k,p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.3, 3, 1.0),
                                   (1.0, -1, 0.8), (0.5, 4, 0.9), (2.0, 0, 0.3),
                                   (1.0, 1, 1.0), (1.0, -1, 1e-6)])
def test_probs_match_numpy(t, k, p):
    got = sampling_probs(LOGITS, SamplingParams(temperature=t, top_k=k, top_p=p)).numpy()
    np.testing.assert_allclose(got, numpy_probs(LOGITS.numpy(), t, k, p), atol=1e-6)


def hf_probs(logits: torch.Tensor, t: float, min_p: float, k: int, p: float) -> np.ndarray:
    """HF's own warpers, chained in vLLM's order (temperature, min-p, top-k, top-p)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = TemperatureLogitsWarper(t)(None, logits[None].double())
    x = MinPLogitsWarper(min_p)(None, x) if min_p > 0 else x
    x = TopKLogitsWarper(k)(None, x) if k > 0 else x
    x = TopPLogitsWarper(p)(None, x) if p < 1 else x
    return torch.softmax(x, -1)[0].numpy()


@pytest.mark.parametrize("t,min_p,k,p", [(1.0, 0.1, -1, 1.0), (0.7, 0.05, -1, 1.0),
                                         (1.3, 0.3, 40, 1.0), (0.9, 0.02, -1, 0.8),
                                         (1.0, 0.2, 25, 0.7), (1.0, 1.0, -1, 1.0)])
def test_min_p_keeps_what_hf_min_p_warper_keeps(t, min_p, k, p):
    """Random logits over 2000 tokens, every row: min_p drops the tokens HF's
    MinPLogitsWarper drops, before top_k and top_p (vLLM's order)."""
    logits = torch.randn(6, 2000, generator=torch.Generator().manual_seed(3)) * 2
    for row in logits:
        got = sampling_probs(row, SamplingParams(temperature=t, min_p=min_p, top_k=k,
                                                 top_p=p)).numpy()
        ref = hf_probs(row, t, min_p, k, p)
        assert np.array_equal(got > 0, ref > 0)
        np.testing.assert_allclose(got, ref, atol=1e-6)


def test_min_p_draws_follow_its_distribution_in_a_batch():
    """sample_rows' batched path (rows sharing their parameters) with min_p: 3000 draws
    of one row, each its own seed, land only on the kept tokens, as often as HF's
    warpers say. min_p keeps 4 tokens, top_p then 3 of them (top_p first, HF's order,
    would keep 4)."""
    logits = torch.tensor([2.0, 1.8, 1.0, 0.5, 0.4, -1.0, 2.6, 0.0])
    params = SamplingParams(temperature=0.9, min_p=0.15, top_p=0.9)
    n = 3000
    got = sample_rows(logits[None].expand(n, -1), [params] * n,
                      [(s,) for s in range(n)], [5] * n)
    freq = np.bincount([t for (t,) in got], minlength=8) / n
    ref = hf_probs(logits, 0.9, 0.15, -1, 0.9)
    assert np.all(freq[ref == 0] == 0) and (ref > 0).sum() == 3
    assert np.abs(freq - ref).max() < 0.03  # 3 sigma ~ 0.027


def test_top_k_past_a_masks_few_tokens_draws_among_them():
    """A mask leaving 3 tokens under top_k 5: the draw's distribution is those 3's
    softmax (the top k holds -inf past them; no tie is looked for there)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.4, -1.0, 3.0, 0.0, -0.2]])
    mask = bytes([0b00100110])  # tokens 1, 2, 5
    params = SamplingParams(temperature=1.0, top_k=5)
    n = 2000
    got = sample_rows(logits.expand(n, -1), [params] * n, [(s,) for s in range(n)],
                      [0] * n, masks=[mask] * n)
    freq = np.bincount([t for (t,) in got], minlength=8) / n
    x = logits[0].numpy()[[1, 2, 5]]
    ref = np.zeros(8)
    ref[[1, 2, 5]] = np.exp(x) / np.exp(x).sum()
    assert np.all(freq[ref == 0] == 0) and np.abs(freq - ref).max() < 0.035


def test_empirical_frequencies_follow_the_distribution():
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    g = torch.Generator().manual_seed(0)
    logits = LOGITS[None].expand(4000, -1)
    draws = sample(logits, [params] * 4000, [g] * 4000)
    freq = np.bincount(draws, minlength=8) / 4000
    ref = numpy_probs(LOGITS.numpy(), 0.8, 5, 0.9)
    assert np.all(freq[ref == 0] == 0)
    assert np.abs(freq - ref).max() < 0.03  # 4000 draws: 3 sigma ~ 0.024


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    p = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))

    def run():
        gens = [torch.Generator().manual_seed(p.seed + i) for i in range(3)]
        return [sample(logits, [p] * 3, gens) for _ in range(5)]

    assert run() == run()
    assert sample(logits, [SamplingParams(temperature=0)] * 3, [None] * 3) == \
        logits.argmax(-1).tolist()


def test_stateless_draws_per_seed_and_position():
    p = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    assert draw_seed(3, 10) == draw_seed(3, 10) and 0 <= draw_seed(2 ** 62, 0) < 2 ** 63
    assert len({draw_seed(s, pos) for s in range(50) for pos in range(50)}) == 2500
    # the same (seed, position) draws the same token whatever else is in the batch
    one = sample_rows(LOGITS[None], [p], [(11,)], [40])
    many = sample_rows(LOGITS[None].expand(3, -1), [p, p, p], [(1, 2), (11,), (5,)], [7, 40, 9])
    assert many[1] == one[0] and [len(t) for t in many] == [2, 1, 1]
    # greedy rows repeat the argmax once per seed
    assert sample_rows(LOGITS[None], [SamplingParams(temperature=0)], [(1, 2, 3)], [0]) == \
        [(5, 5, 5)]
    # over many seeds the draws follow the NumPy distribution
    draws = [t for row in sample_rows(LOGITS[None], [p], [tuple(range(4000))], [3]) for t in row]
    freq = np.bincount(draws, minlength=8) / 4000
    ref = numpy_probs(LOGITS.numpy(), 0.8, 5, 0.9)
    assert np.all(freq[ref == 0] == 0) and np.abs(freq - ref).max() < 0.03


@pytest.mark.parametrize("first", [256, 2])  # 2: the nucleus widens 2 -> 8 over 8 tokens
def test_draws_follow_numpy_over_seeds(monkeypatch, first):
    """sample_rows' draws (inverse CDF, one uniform per (seed, position)) over many seeds
    follow the NumPy distribution for each kind of row, top_k ties included."""
    from lamina.sampling import sampler

    monkeypatch.setattr(sampler, "NUCLEUS_FIRST", first)
    tied = torch.tensor([2.0, 1.0, 1.0, 1.0, -1.0, 3.0, 0.0, 1.0])  # 3rd logit shared 4 times
    for logits, (t, k, p) in [(LOGITS, (1.0, -1, 1.0)), (LOGITS, (0.8, -1, 0.7)),
                              (LOGITS, (1.2, 3, 0.95)), (tied, (1.0, 3, 1.0)),
                              (tied, (0.9, 2, 0.6))]:
        params = SamplingParams(temperature=t, top_k=k, top_p=p)
        draws = [x for row in sample_rows(logits[None], [params], [tuple(range(6000))], [1])
                 for x in row]
        freq = np.bincount(draws, minlength=8) / 6000
        ref = numpy_probs(logits.numpy(), t, k, p)
        assert np.all(freq[ref == 0] == 0), (t, k, p)
        assert np.abs(freq - ref).max() < 0.025, (t, k, p)  # 6000 draws: 3 sigma ~ 0.02


def test_draws_over_blocks_of_the_vocabulary_follow_numpy():
    """draw_tokens races blocks of BLOCK tokens, then the winner's tokens: on a
    1000-token vocabulary (three whole blocks and a part) with likely tokens in every
    block, and mass spread over the rest, the draws over many seeds follow NumPy's
    distribution for each kind of row (every token, top_k, top_p, both)."""
    from lamina.sampling.sampler import BLOCK

    V = 1000
    assert V % BLOCK and V > 3 * BLOCK
    logits = torch.randn(V, generator=torch.Generator().manual_seed(7)) * 0.5
    top = [3, 200, 255, 256, 511, 600, 768, 999]  # both sides of blocks' edges
    logits[top] = torch.tensor([4.0, 3.5, 3.0, 4.2, 2.5, 3.8, 1.0, 3.9])
    for t, k, p in [(1.0, -1, 1.0), (0.8, 5, 1.0), (1.0, -1, 0.6), (1.2, 6, 0.9)]:
        params = SamplingParams(temperature=t, top_k=k, top_p=p)
        draws = [x for row in sample_rows(logits[None], [params], [tuple(range(6000))],
                                          [2]) for x in row]
        ref = numpy_probs(logits.numpy(), t, k, p)
        freq = np.bincount(draws, minlength=V) / 6000
        assert np.all(freq[ref == 0] == 0), (t, k, p)
        # each likely token, and the rest of each block together
        buckets = [[i] for i in top] + [
            [i for i in range(b, min(b + BLOCK, V)) if i not in top]
            for b in range(0, V, BLOCK)]
        for ids in buckets:
            assert abs(freq[ids].sum() - ref[ids].sum()) < 0.025, (t, k, p, ids)


def test_a_draw_keeps_its_token_when_the_logits_move_by_rounding(smol):
    """A sequence's logits differ by float rounding with what else its step holds, how
    its prompt was chunked, or after a recomputation. SmolLM2 reads a context of random
    words whole and as 100 + 200 tokens over its KV cache (logits ~1e-5 apart): every
    draw at positions 100-299 over 40 seeds is the same from both. Placing one uniform
    among the running sums (the sampler before) changed 14 of these 8000 draws at
    temperature 1 and 8 with top_p 0.95."""
    from lamina.bench.draws import changed_draws, whole_and_chunked

    whole, chunked = whole_and_chunked(smol)
    assert 1e-6 < float((whole - chunked)[100:].abs().max()) < 1e-3
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0,
                                                                   top_p=0.95)):
        assert changed_draws(whole, chunked, params, tuple(range(40)), range(100, 300)) \
            == [], params


def test_a_draw_does_not_depend_on_the_rest_of_the_batch():
    """Rows drawn together (grouped by their parameters, worked on a few at a time) draw
    what each draws alone, on a 49k bf16 vocabulary: ties at the k-th logit, flat rows
    whose top_p set needs thousands of tokens, penalized and greedy rows mixed in."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(11, 49152, generator=g) * 3).to(torch.bfloat16)
    logits[2, :300] = logits[2].max()  # 300 tokens tie for the top: top_k 50 keeps all
    logits[5] = torch.randn(49152, generator=g).to(torch.bfloat16) * 0.1  # nearly flat
    kinds = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=50),
             SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0),
             SamplingParams(temperature=0.8, top_k=40, top_p=0.8),
             SamplingParams(temperature=1.0, repetition_penalty=1.2)]
    params = [kinds[i] for i in (0, 1, 1, 3, 2, 2, 4, 0, 5, 1, 2)]  # row 2: ties; 5: flat
    seeds = [(i, 100 + i) for i in range(11)]
    hist = [((1, 2, 3), 1) if p.penalized else None for p in params]
    together = sample_rows(logits, params, seeds, list(range(11)), hist)
    alone = [sample_rows(logits[r:r + 1], [params[r]], [seeds[r]], [r], [hist[r]])[0]
             for r in range(11)]
    assert together == alone
    assert together[2][0] < 300 and together[2][1] < 300  # from the tied top tokens


def test_bf16_logits_draw_what_their_fp32_copy_draws():
    """The compute side hands sample_rows the model's bf16 logits: greedy rows take the
    compiled argmax over them, drawn and penalized rows work in fp32 (as HF's logits
    processors do), so every row draws what the fp32 copy draws."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 49152, generator=g) * 4).to(torch.bfloat16)
    logits[1, 100] = logits[1, 7] = logits[1].max() + 1  # a tie: the first index wins
    greedy = SamplingParams(temperature=0)
    params = [greedy, greedy, SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
              SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, frequency_penalty=0.5, logit_bias=((3, 5.0),)),
              greedy]
    seeds, pos = [(1,), (2,), (3, 4), (5,), (6,), (7, 8)], [10, 11, 12, 13, 14, 15]
    hist = [None, None, None, ((7, 9, 100, 7), 2), ((1, 2, 3, 3), 1), None]
    got = sample_rows(logits, params, seeds, pos, hist)
    assert got == sample_rows(logits.float(), params, seeds, pos, hist)
    assert got[1] == (7,) and got[0] == (int(logits[0].float().argmax()),)
    assert got[5] == (int(logits[5].float().argmax()),) * 2


@pytest.mark.parametrize("kw,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"), ({"seed": -1}, "seed"), ({"stop": ("",)}, "stop"),
    ({"stop_token_ids": (-5,)}, "stop_token_ids"), ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": True}, "min_p"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"), ({"bad_words": [7]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -1}, "truncate_prompt_tokens"),
])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_row_logprobs_match_numpy_log_softmax():
    rows = torch.stack([LOGITS, LOGITS.flip(0) * 2, LOGITS - 5])
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=0)]
    tokens = [(5, 2), (1,), (7,)]  # row 0 drew two tokens (n=2 forks)
    out = row_logprobs(rows, params, tokens)
    x = rows.double().numpy()
    ref = x - x.max(1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(1, keepdims=True))
    assert out[1] is None and len(out[0]) == 2 and len(out[2]) == 1
    for r, toks in [(0, (5, 2)), (2, (7,))]:
        for entry, t in zip(out[r], toks):
            lp, ids, vals = entry
            assert lp == pytest.approx(ref[r, t], abs=1e-6)
            k = params[r].logprobs
            assert list(ids) == list(np.argsort(-ref[r], kind="stable")[:k])
            assert np.allclose(vals, np.sort(ref[r])[::-1][:k], atol=1e-6)
    assert out[0][0][1] == (5, 0, 1) and out[2][0][1] == ()


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True])
def test_logprobs_param_checked(bad):
    with pytest.raises(ValueError, match="SamplingParams.logprobs"):
        SamplingParams(logprobs=bad)
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


@pytest.mark.parametrize("k", [0, 4])
def test_prompt_logprobs_match_numpy_across_chunks(k):
    """600 prompt rows: more than two log-softmax chunks of 256."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(600, 50, generator=g) * 4
    nxt = torch.randint(0, 50, (600,), generator=g).tolist()
    chosen, ids, vals = prompt_logprobs(logits, nxt, k)
    x = logits.double().numpy()
    ref = x - x.max(1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(1, keepdims=True))
    assert np.allclose(chosen, ref[np.arange(600), nxt], atol=1e-5)
    assert len(ids) == len(vals) == 600
    if k:
        assert [list(r) for r in ids] == np.argsort(-ref, 1, kind="stable")[:, :k].tolist()
        assert np.allclose(vals, -np.sort(-ref, 1)[:, :k], atol=1e-5)
    else:
        assert ids == vals == [()] * 600


def test_penalties_match_numpy():
    """Repetition (HF): each token seen in prompt or output once, logit / p if > 0 else
    * p. Presence and frequency (OpenAI): drawn tokens only, by count."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, generator=g) * 3
    history, plen = (3, 9, 3, 17, 5, 5, 5, 22, 9), 4  # prompt 3 9 3 17 | drawn 5 5 5 22 9
    p = SamplingParams(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, p, history, plen).double().numpy()
    x = logits.double().numpy().copy()
    for t in set(history):
        x[t] = x[t] / 1.7 if x[t] > 0 else x[t] * 1.7
    for t, c in {5: 3, 22: 1, 9: 1}.items():
        x[t] -= 0.25 * c + 0.5
    assert np.allclose(got, x, atol=1e-5)
    assert torch.equal(apply_penalties(logits, SamplingParams(), history, plen), logits)
    # greedy draws from the penalized row; the caller's logits stay untouched
    rows = logits[None].clone()
    tok = sample_rows(rows, [SamplingParams(temperature=0, frequency_penalty=2)], [(0,)], [9],
                      [((int(logits.argmax()),) * 3, 0)])
    assert tok[0][0] != int(logits.argmax()) and torch.equal(rows[0], logits)


@pytest.mark.parametrize("kw,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": True}, "presence_penalty"),
])
def test_penalty_params_checked(kw, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_logit_bias_added_before_the_draw():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    p = SamplingParams(temperature=0, logit_bias={2: 1.5, 0: -100})
    assert p.logit_bias == ((0, -100), (2, 1.5))
    assert sample_rows(logits[None], [p], [(0,)], [0])[0] == (2,)  # 2 + 1.5 > 3
    # sampled: the distribution is softmax(logits + bias)
    q = SamplingParams(temperature=1.0, logit_bias={3: 3.0})
    draws = [sample_rows(logits[None], [q], [(s,)], [0])[0][0] for s in range(4000)]
    x = np.array([1.0, 3.0, 2.0, 3.5])
    want = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    freq = np.bincount(draws, minlength=4) / 4000
    assert np.abs(freq - want).max() < 0.03


@pytest.mark.parametrize("bad", [{1: 101}, {-1: 0.5}, {True: 1.0}, {1: "a"}])
def test_logit_bias_checked(bad):
    with pytest.raises(ValueError, match="SamplingParams.logit_bias"):
        SamplingParams(logit_bias=bad)
