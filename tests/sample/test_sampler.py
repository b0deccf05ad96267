"""Sampler and penalties on hand-made logits: each parameter's exact effect."""

from __future__ import annotations

import math
import random

import pytest
import torch

from brisk.kernels import cpu as cpu_kernels
from brisk.kernels.backend import KernelBackend, choose_backend
from brisk.sample.penalties import Penalties
from brisk.sample.random import to_int64, uniforms
from brisk.sample.sampler import SamplingBatch, SamplingRow, sample
from brisk.sample.params import SamplingError, SamplingParams
from tests.helpers import require_c_compiler

CPU = torch.device("cpu")


@pytest.fixture(params=["kernel", "torch"])
def path(request) -> KernelBackend:
    """Runs a test through the C kernel and through the torch formulation (GPUs, no compiler)."""
    if request.param == "kernel":
        require_c_compiler()
        return cpu_kernels.CBackend()
    return KernelBackend()


def _rows(*params: SamplingParams, prompt=(1, 2, 3), output=(), seeds=None) -> list[SamplingRow]:
    """One row per params, all with the same tokens; EOS is token 0. Row i's seed is params.seed, else i."""
    return [SamplingRow(p, [*prompt, *output], len(prompt), eos_token_ids=(0,),
                        seed=p.seed if p.seed is not None else (seeds[i] if seeds else i))
            for i, p in enumerate(params)]


def _penalties(params: SamplingParams, prompt, output) -> Penalties:
    return Penalties.from_tokens([0], [params], [list(prompt)], [list(output)], 4, CPU)


def _sample(logits: torch.Tensor, rows: list[SamplingRow], kernels: KernelBackend | None = None):
    """Samples in `kernels`, by default the backend this host's models get."""
    return sample(logits.clone(), SamplingBatch.from_rows(rows, logits.shape[-1], CPU), kernels or choose_backend(CPU))


def _counts(logits_row: list[float], params: SamplingParams, kernels: KernelBackend,
            draws: int = 400) -> torch.Tensor:
    logits = torch.tensor([logits_row] * draws)
    tokens = _sample(logits, _rows(*[params] * draws), kernels).token_ids
    return torch.bincount(tokens, minlength=len(logits_row))


def _exact_distribution(logits_row: list[float], params: SamplingParams) -> list[float]:
    """The sampler's rule (module docstring of brisk/sample/sampler.py), written out plainly."""
    top = max(logits_row)
    w = [math.exp((z - top) / params.temperature) for z in logits_row]
    w = [x if x >= params.min_p else 0.0 for x in w]
    ordered = sorted(w, reverse=True)
    if params.top_k:
        w = [x if x >= ordered[params.top_k - 1] else 0.0 for x in w]
        ordered = sorted(w, reverse=True)
    if params.top_p < 1:
        running, goal = 0.0, params.top_p * sum(ordered)
        edge = next(x for x in ordered if (running := running + x) >= goal)
        w = [x if x >= edge else 0.0 for x in w]
    return [x / sum(w) for x in w]


def _chi_square_p_value(counts: torch.Tensor, probs: list[float]) -> float:
    """P(chi-square >= observed) for draws against probabilities. Tokens expected fewer than 5 times
    share one bin (the test's usual validity rule); drawing a token of probability 0 fails outright."""
    total = counts.sum().item()
    assert all(counts[i] == 0 for i, p in enumerate(probs) if p == 0), "a token outside the support was drawn"
    bins = [(counts[i].item(), total * p) for i, p in enumerate(probs) if total * p >= 5]
    rest = [(counts[i].item(), total * p) for i, p in enumerate(probs) if 0 < total * p < 5]
    if rest:
        bins.append((sum(c for c, _ in rest), sum(e for _, e in rest)))
    statistic = sum((observed - expected) ** 2 / expected for observed, expected in bins)
    df = torch.tensor((len(bins) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, torch.tensor(statistic / 2, dtype=torch.float64)).item()


def test_uniforms_match_splitmix64_on_python_integers():
    mask = 2**64 - 1

    def mix(x):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    rng = random.Random(0)
    seeds = [rng.randrange(-2**63, 2**64) for _ in range(500)] + [0, -1, 2**64 - 1, 2**63]
    positions = [rng.randrange(0, 2**31) for _ in range(len(seeds))]
    got = uniforms(torch.tensor([to_int64(s) for s in seeds]), torch.tensor(positions)).tolist()
    expected = [(mix((mix(s % 2**64) + (n + 1) * 0x9E3779B97F4A7C15) & mask) >> 11) * 2.0**-53
                for s, n in zip(seeds, positions)]
    assert got == expected


def test_uniforms_of_neighbouring_seeds_and_positions_are_evenly_spread():
    """Consecutive seeds at one position, and one seed at consecutive positions: each decile of
    [0, 1) gets its tenth of 100,000 draws (4 standard deviations is about 4%)."""
    n = 100_000
    for seeds, positions in [(torch.arange(n), torch.zeros(n, dtype=torch.long)),
                             (torch.zeros(n, dtype=torch.long), torch.arange(n))]:
        deciles = torch.histc(uniforms(seeds, positions).float(), bins=10, min=0, max=1)
        assert ((deciles - n / 10).abs() < 0.04 * n / 10).all()


@pytest.mark.parametrize("rows,vocab,spread", [(512, 3000, 8.0), (48, 49152, 0.5)], ids=["peaked", "flat"])
def test_kernel_follows_the_torch_formulation_token_for_token(rows, vocab, spread):
    """Rows from sharp to flat: a flat row's nucleus holds most of a real vocabulary, where the
    kernel's selection takes many rounds before it sorts what is left."""
    require_c_compiler()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g) * spread
    logits[::7, :5] = float("-inf")  # banned tokens

    def mixed(off, draw):
        return torch.where(torch.rand(rows, generator=g) < 0.5, off, draw)

    batch = SamplingBatch(
        temperature=mixed(0.0, torch.rand(rows, generator=g) * 1.5 + 0.05),
        top_k=mixed(0, torch.randint(1, 300, (rows,), generator=g)),
        top_p=mixed(1.0, torch.rand(rows, generator=g) * 0.99 + 0.01),
        min_p=mixed(0.0, torch.rand(rows, generator=g) * 0.5),
        uniforms=uniforms(torch.arange(rows), torch.zeros(rows, dtype=torch.long)),
        penalties=None, bans=None, biases=None, grammar_rows=None, bitmask=None,
        num_logprobs=None)
    batch.top_k, batch.top_p, batch.min_p = batch.top_k.long(), batch.top_p.float(), batch.min_p.float()
    columns = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.uniforms)
    kernel = cpu_kernels.sample_rows(logits, *columns)
    assert torch.equal(kernel, KernelBackend().sample_rows(logits.clone(), *columns))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.95),
    SamplingParams(temperature=1.3, top_k=4, top_p=0.9),
    SamplingParams(temperature=0.9, min_p=0.05, top_p=0.8),
], ids=["plain", "top_p", "top_k_top_p", "min_p_top_p"])
def test_draws_follow_the_exact_distribution(path, params):
    """Chi-square of 6,000 draws (seeds 0..5999 at one position) against the rule's probabilities."""
    logits_row = [2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0]
    draws = 6000
    counts = _counts(logits_row, params, path, draws=draws)
    assert _chi_square_p_value(counts, _exact_distribution(logits_row, params)) > 1e-4


def test_draws_of_a_tiny_model_follow_its_softmax(path, tmp_path):
    """End to end: the first token of 3,000 seeded requests against transformers' softmax on the same weights."""
    from brisk import LLM
    from tests.conftest import build_tiny_checkpoint, load_hf_reference

    folder = build_tiny_checkpoint(str(tmp_path), "llama")
    prompt, draws = [5, 9, 13], 3000
    params = [SamplingParams(temperature=2.0, top_p=0.95, max_tokens=1, ignore_eos=True, seed=s) for s in range(draws)]
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_model_len=64)
    llm.engine.model.use_kernels(path)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * draws, params, use_tqdm=False)
    reference = load_hf_reference(folder)(torch.tensor([prompt])).logits[0, -1].tolist()
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outputs]), minlength=len(reference))
    assert _chi_square_p_value(counts, _exact_distribution(reference, params[0])) > 1e-4


def test_top_k_1_is_greedy(path):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    out = _sample(logits, _rows(*[SamplingParams(temperature=1.5, top_k=1)] * 64), path)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_rows_take_the_argmax_next_to_sampled_rows(path):
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    out = _sample(logits, _rows(SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
                                SamplingParams(temperature=1.0, top_k=1)), path)
    assert out.token_ids.tolist() == [1, 0, 2]


def test_top_p_keeps_the_smallest_nucleus(path):
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = _counts([math.log(p) for p in probs], SamplingParams(top_p=0.75), path)
    assert counts[2] == 0 and counts[3] == 0 and counts[0] > 0 and counts[1] > 0


def test_min_p_drops_tokens_below_a_fraction_of_the_best(path):
    counts = _counts([math.log(p) for p in (0.6, 0.3, 0.1)], SamplingParams(min_p=0.5), path)
    assert counts[2] == 0 and counts[1] > 0


def test_a_zero_uniform_takes_the_first_kept_token_not_a_dropped_one(path):
    """u = 0 selects the smallest id with weight: masked, banned and truncated tokens have none."""
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0], [float("-inf"), 1.0, 3.0, 2.0], [0.0, 5.0, 4.0, -1.0]])
    params = [SamplingParams(top_k=2), SamplingParams(temperature=1.0), SamplingParams(top_p=0.5)]
    batch = SamplingBatch.from_rows(_rows(*params), 4, CPU)
    batch.uniforms = torch.zeros(3, dtype=torch.float64)
    assert sample(logits.clone(), batch, path).token_ids.tolist() == [1, 1, 1]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch(path):
    row = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = [_sample(row, _rows(seeded), path).token_ids.item() for _ in range(3)]
    crowd = torch.cat([torch.randn(5, 100), row])
    in_batch = _sample(crowd, _rows(*[SamplingParams()] * 5, seeded), path).token_ids[-1].item()
    assert alone == [alone[0]] * 3 and in_batch == alone[0]


def test_each_position_draws_afresh():
    """Same seed, successive output positions: different uniforms, so not one token repeated."""
    row = torch.zeros(1, 1000)  # uniform over 1000 tokens
    params = SamplingParams(temperature=1.0, seed=3)
    tokens = {_sample(row, _rows(params, output=[7] * n)).token_ids.item() for n in range(20)}
    assert len(tokens) > 15


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 0.0, 8.0, 1.0]])  # EOS (0) best, stop id 2 next
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert _sample(logits, _rows(params, output=[3])).token_ids.item() == 3
    assert _sample(logits, _rows(params, output=[3, 3])).token_ids.item() == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    penalties = _penalties(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,))
    assert penalties.apply(logits).tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(1, 4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    penalties = _penalties(params, prompt=(3, 3), output=(1, 1, 2))
    assert penalties.apply(logits).tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_penalty_tensors_only_for_the_rows_that_use_them():
    plain = SamplingBatch.from_rows(_rows(SamplingParams(), SamplingParams()), 4, CPU)
    mixed = SamplingBatch.from_rows(_rows(SamplingParams(), SamplingParams(presence_penalty=0.5), SamplingParams(),
                                          output=(2,)), 4, CPU)
    assert plain.penalties is None
    # row 1's seen tokens only: the prompt's 1, 2, 3 and its output 2
    assert mixed.penalties.rows.tolist() == [1, 1, 1] and mixed.penalties.token_ids.tolist() == [1, 2, 3]
    assert mixed.penalties.output_counts.tolist() == [0, 1, 0]
    logits = torch.zeros(3, 4)
    assert mixed.adjust(logits, KernelBackend())[:, 2].tolist() == [0.0, -0.5, 0.0]


def test_sparse_penalties_equal_the_dense_formula():
    """Random rows, prompts and outputs over a vocabulary of 50: every logit as the dense [B, V]
    formula (counts over the vocabulary, repetition where seen) computes it, bit for bit."""
    g = torch.Generator().manual_seed(0)
    vocab, batch = 50, 6
    params = [SamplingParams(repetition_penalty=1 + i / 4, presence_penalty=i / 3 - 0.5, frequency_penalty=0.3 * i - 1)
              for i in range(batch)]
    prompts = [torch.randint(vocab, (int(torch.randint(0, 20, (1,), generator=g)),), generator=g).tolist()
               for _ in range(batch)]
    outputs = [torch.randint(vocab, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(batch)]
    logits = torch.randn(batch, vocab, generator=g) * 3
    counts = torch.tensor([[o.count(t) for t in range(vocab)] for o in outputs], dtype=torch.float32)
    seen = torch.tensor([[t in p or t in o for t in range(vocab)] for p, o in zip(prompts, outputs)])
    column = lambda name: torch.tensor([getattr(p, name) for p in params])[:, None]  # noqa: E731
    repetition = column("repetition_penalty")
    expected = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    expected = torch.where(seen, expected - column("frequency_penalty") * counts
                           - column("presence_penalty") * (counts > 0).float(), expected)
    penalties = Penalties.from_tokens(list(range(batch)), params, prompts, outputs, vocab, CPU)
    assert torch.equal(penalties.apply(logits.clone()), expected)


def test_logprobs_are_raw_model_logprobs_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = _sample(logits, _rows(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5)))
    expected = torch.log_softmax(logits, -1)
    assert out.token_ids.item() == 1 and out.logprobs.target_ranks.item() == 1
    assert torch.allclose(out.logprobs.target_logprobs, expected[:, 1])
    assert out.logprobs.top_token_ids.tolist() == [[1, 2]]
    assert torch.allclose(out.logprobs.top_logprobs, expected[:, [1, 2]])


def test_no_logprob_tensors_unless_a_row_asks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]] * 2)
    assert _sample(logits, _rows(SamplingParams(), SamplingParams(temperature=0.0))).logprobs is None
    asked = _sample(logits, _rows(SamplingParams(), SamplingParams(logprobs=0))).logprobs
    assert asked.target_ranks.shape == (2,) and asked.top_token_ids is None


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("logprobs", -1), ("stop", [""]),
    # wrong types, which a Python caller can pass (the server's bodies are typed): named, not a bare TypeError
    ("max_tokens", 2.5), ("max_tokens", "3"), ("temperature", "hot"), ("temperature", None), ("seed", "abc"),
    ("n", 2.0), ("stop", 5), ("stop", ["a", 1]), ("stop_token_ids", [1.5]), ("ignore_eos", 1), ("top_k", True),
])
def test_invalid_params_raise_an_error_naming_the_field(field, value):
    with pytest.raises(SamplingError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(SamplingError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
