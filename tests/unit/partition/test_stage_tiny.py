"""Stages of seeded random tiny models reproduce the full transformers model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hetmesh.errors import InvalidRequest
from hetmesh.partition.generate import LocalPipeline, balanced_ranges
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.stage import (
    PAD_WASTE_TOKENS,
    StageModule,
    _BatchCache,
    load_stage,
    padding_groups,
)
from tests.unit.partition.tiny_models import (
    EOS,
    FAMILIES,
    VOCAB,
    greedy_reference,
    reference_logits,
    save_tiny,
)

ATOL = 1e-4
# units of a 4-layer model: 0 embed, 1..4 layers, 5 head
SPLITS = {
    "1": [(0, 6)],
    "2": [(0, 3), (3, 6)],
    "3-uneven": [(0, 4), (4, 5), (5, 6)],
    "5-embed-only-head-only": [(0, 1), (1, 2), (2, 4), (4, 5), (5, 6)],
    "embed+layer|rest": [(0, 2), (2, 6)],
}


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(request.param)
    model = save_tiny(request.param, folder)
    return request.param, folder, model


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(4, VOCAB, (33,), generator=gen)


def _chain(stages: list[StageModule], kvs: list[Any], x: torch.Tensor) -> torch.Tensor:
    for stage, kv in zip(stages, kvs, strict=True):
        x = stage.forward(x, kv)
    return x


@pytest.mark.parametrize("split", list(SPLITS))
def test_stage_chain_matches_full_model_prefill_and_decode(
    tiny: Any, prompt: torch.Tensor, split: str
) -> None:
    _, folder, model = tiny
    gen = torch.Generator().manual_seed(3)
    steps = [int(t) for t in torch.randint(4, VOCAB, (20,), generator=gen)]
    ref_prefill, ref_steps = reference_logits(model, prompt, steps)
    stages = [load_stage(folder, a, b) for a, b in SPLITS[split]]
    kvs = [s.new_kv() for s in stages]
    torch.testing.assert_close(_chain(stages, kvs, prompt), ref_prefill, atol=ATOL, rtol=0)
    for token, ref in zip(steps, ref_steps, strict=True):
        out = _chain(stages, kvs, torch.tensor([token]))
        torch.testing.assert_close(out[-1], ref, atol=ATOL, rtol=0)
    assert [kv.length for kv in kvs] == [len(prompt) + 20] * len(stages)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
def test_greedy_generation_matches_transformers_generate(
    tiny: Any, prompt: torch.Tensor, num_stages: int
) -> None:
    _, folder, model = tiny
    expected = greedy_reference(model, prompt, 20)
    pipeline = LocalPipeline.load(folder, num_stages)
    assert len(pipeline.stages) == num_stages
    got = list(
        pipeline.generate_ids(prompt.tolist(), SamplingParams(max_new_tokens=20), eos_ids={EOS})
    )
    assert got == expected


def test_chunked_prefill_matches_one_prefill(tiny: Any, prompt: torch.Tensor) -> None:
    _, folder, model = tiny
    ref_prefill, _ = reference_logits(model, prompt, [])
    stages = [load_stage(folder, 0, 3), load_stage(folder, 3, 6)]
    kvs = [s.new_kv() for s in stages]
    first = _chain(stages, kvs, prompt[:20])
    second = _chain(stages, kvs, prompt[20:])
    torch.testing.assert_close(torch.cat([first, second]), ref_prefill, atol=ATOL, rtol=0)


def test_forward_batch_matches_separate_forwards(tiny: Any) -> None:
    """Sessions at KV lengths 0, 5, 17, 30 mixing prefill chunks and decode steps."""
    _, folder, _ = tiny
    gen = torch.Generator().manual_seed(11)
    histories = [torch.randint(4, VOCAB, (n,), generator=gen) for n in (0, 5, 17, 30)]
    chunks = [torch.randint(4, VOCAB, (n,), generator=gen) for n in (9, 1, 4, 1)]
    for start, end in [(0, 6), (0, 2), (2, 5), (5, 6)]:
        stage = load_stage(folder, start, end)
        first = load_stage(folder, 0, start) if start else None

        def feed(x: torch.Tensor, kv_first: Any, kv: Any) -> torch.Tensor:
            return first.forward(x, kv_first) if first is not None else x  # noqa: B023

        solo, batched = [], []
        for history, chunk in zip(histories, chunks, strict=True):
            pair = []
            for _ in range(2):  # identical state for the solo and the batched run
                kv_first = first.new_kv() if first is not None else None
                kv = stage.new_kv()
                if len(history):
                    stage.forward(feed(history, kv_first, kv), kv)
                pair.append((feed(chunk, kv_first, kv), kv))
            solo.append(stage.forward(*pair[0]))
            batched.append(pair[1])
        outputs = stage.forward_batch(batched)
        for got, want in zip(outputs, solo, strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert [kv.length for _, kv in batched] == [9, 6, 21, 31]


def test_eager_attention_matches_sdpa(tiny: Any, prompt: torch.Tensor) -> None:
    _, folder, model = tiny
    ref_prefill, _ = reference_logits(model, prompt, [])
    stages = [load_stage(folder, 0, 3, attn_implementation="eager"), load_stage(folder, 3, 6)]
    kvs = [s.new_kv() for s in stages]
    for part in (slice(0, 10), slice(10, None)):
        got = _chain(stages, kvs, prompt[part])
        torch.testing.assert_close(got, ref_prefill[part], atol=ATOL, rtol=0)


@pytest.mark.parametrize(("start", "end"), [(0, 6), (0, 1), (5, 6), (1, 5), (2, 3), (0, 2), (4, 6)])
def test_stage_param_count_matches_profile(tiny: Any, start: int, end: int) -> None:
    _, folder, model = tiny
    stage = load_stage(folder, start, end)
    assert stage.param_count() == stage.profile.range_param_count(start, end)
    if (start, end) == (0, 6):
        assert stage.param_count() == sum(p.numel() for p in model.parameters())
    assert not any(p.is_meta for p in stage.parameters())


def test_tied_stage_shares_one_matrix(tiny: Any) -> None:
    _, folder, model = tiny
    stage = load_stage(folder, 0, 6)
    assert stage.embed_tokens is not None
    assert stage.lm_head is not None
    shared = stage.lm_head.weight is stage.embed_tokens.weight
    assert shared == model.config.tie_word_embeddings
    # exact_linears would hold an untied fp32 head packed (a placeholder as its weight)
    head_only = load_stage(folder, 5, 6, exact_linears=False)
    assert head_only.lm_head is not None
    torch.testing.assert_close(head_only.lm_head.weight, model.lm_head.weight, atol=0, rtol=0)


def test_balanced_ranges_cover_every_unit(tiny: Any) -> None:
    _, folder, _ = tiny
    profile = load_stage(folder, 0, 1).profile
    for k in range(1, profile.num_units + 1):
        ranges = balanced_ranges(profile, k)
        assert len(ranges) == k
        assert ranges[0][0] == 0
        assert ranges[-1][1] == profile.num_units
        assert all(a < b for a, b in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(k - 1))
    with pytest.raises(InvalidRequest):
        balanced_ranges(profile, profile.num_units + 1)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama-validation")
    save_tiny("llama-untied", folder)
    return folder


def test_stage_rejects_bad_inputs(llama_dir: Path) -> None:
    first, middle = load_stage(llama_dir, 0, 2), load_stage(llama_dir, 2, 6)
    kv = first.new_kv()
    bad_first = [
        torch.zeros(4),  # floats to the embedding
        torch.zeros((1, 4), dtype=torch.int64),  # a batch dimension
        torch.tensor([VOCAB]),  # outside the vocabulary
        torch.tensor([-1]),
        torch.zeros(0, dtype=torch.int64),  # empty
    ]
    for x in bad_first:
        with pytest.raises(InvalidRequest):
            first.forward(x, kv)
    bad_middle = [torch.zeros(3, 65), torch.zeros(3), torch.zeros((3, 64), dtype=torch.int64)]
    for x in bad_middle:
        with pytest.raises(InvalidRequest):
            middle.forward(x, middle.new_kv())
    with pytest.raises(InvalidRequest, match="another stage"):
        middle.forward(torch.zeros(2, 64), kv)
    with pytest.raises(InvalidRequest, match="twice"):
        first.forward_batch([(torch.tensor([5]), kv), (torch.tensor([6]), kv)])
    assert kv.length == 0  # nothing above touched the session


def test_stage_rejects_context_overflow_and_freed_kv(llama_dir: Path) -> None:
    stage = load_stage(llama_dir, 0, 6)
    kv = stage.new_kv()
    stage.forward(torch.arange(96) % 90 + 4, kv)
    with pytest.raises(InvalidRequest, match="exceeds"):
        stage.forward(torch.arange(4, 37), kv)  # 96 + 33 > 128
    stage.forward(torch.arange(4, 36), kv)  # exactly 128
    assert kv.length == 128
    kv.free()
    assert kv.freed
    assert kv.nbytes == 0
    with pytest.raises(InvalidRequest, match="freed"):
        stage.forward(torch.tensor([5]), kv)


def test_load_stage_rejects_bad_ranges(llama_dir: Path) -> None:
    for start, end in [(0, 0), (3, 2), (-1, 2), (0, 7)]:
        with pytest.raises(InvalidRequest):
            load_stage(llama_dir, start, end)
    with pytest.raises(InvalidRequest):
        load_stage(llama_dir, 0, 2, attn_implementation="flash")


def test_session_kv_accounting_and_truncate(llama_dir: Path) -> None:
    stage = load_stage(llama_dir, 1, 3)  # two layers, 2 KV heads of 16 dims
    kv = stage.new_kv()
    assert (kv.length, kv.nbytes, kv.used_bytes) == (0, 0, 0)
    hidden = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
    full = stage.forward(hidden, kv)
    per_token = 2 * 2 * 2 * 16 * 4
    assert stage.kv_bytes_per_token() == per_token
    assert kv.used_bytes == 10 * per_token
    assert kv.nbytes >= kv.used_bytes
    kv.truncate(6)  # replay the last four tokens: same outputs
    again = stage.forward(hidden[6:], kv)
    torch.testing.assert_close(again, full[6:], atol=ATOL, rtol=0)
    with pytest.raises(InvalidRequest):
        kv.truncate(11)


def test_sessions_sharing_a_fragmented_pool_match_private_caches(tiny: Any) -> None:
    """Three sessions grow in turn in one small pool, so their block tables interleave
    (gathered reads) or stay runs (views); every output equals a private cache's exactly."""
    _, folder, _ = tiny
    stage = load_stage(folder, 0, 6)
    pool = stage.new_pool(16)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen) for n in (17, 3, 30)]
    shared = [stage.new_kv(pool) for _ in prompts]
    private = [stage.new_kv() for _ in prompts]
    for kv, p in zip(shared, prompts, strict=True):
        assert kv.reserve(len(p))  # as a stage server does before the forward
    outputs = [
        stage.forward_batch(list(zip(prompts, kvs, strict=True))) for kvs in (shared, private)
    ]
    for got, want in zip(*outputs, strict=True):
        assert torch.equal(got, want)
    steps = torch.randint(4, VOCAB, (3, 20), generator=gen)
    for step in range(20):
        for row in range(3):  # one at a time: each grows past block ends in turn
            x = steps[row, step : step + 1]
            assert torch.equal(stage.forward(x, shared[row]), stage.forward(x, private[row]))
        batch = stage.forward_batch(
            [(steps[r, step : step + 1], kv) for r, kv in enumerate(shared)], last_only=True
        )
        want = stage.forward_batch(
            [(steps[r, step : step + 1], kv) for r, kv in enumerate(private)], last_only=True
        )
        for got, ref in zip(batch, want, strict=True):
            assert torch.equal(got, ref)
    assert not all(kv.contiguous for kv in shared)  # some reads really were gathered
    # the shared pool's decode rounds took the one-gather path; private caches the rows'
    assert _BatchCache(shared, [1, 1, 1])._decode is not None
    assert _BatchCache(private, [1, 1, 1])._decode is None
    assert _BatchCache(shared, [1, 2, 1])._decode is None  # a prefill row: row by row
    assert pool.free_blocks < pool.num_blocks
    for kv in shared:
        kv.free()
    assert pool.free_blocks == pool.num_blocks


def test_padding_groups_keep_decode_rows_apart_from_a_prompt() -> None:
    # two decode rows beside a new session's 36-token prompt: padded together they
    # would cost 3 x 36 positions for 38 tokens of work
    assert padding_groups([1, 36, 1]) == [[0, 2], [1]]
    assert padding_groups([1, 1, 1, 1]) == [[0, 1, 2, 3]]  # a decode round: one forward
    assert padding_groups([120, 128]) == [[0, 1]]  # 8 padded positions: still one
    assert padding_groups([64, 128]) == [[0], [1]]
    assert padding_groups([36]) == [[0]]
    assert padding_groups([]) == []
    # every row exactly once, and no group pads more than the bound
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 200, (40,), generator=gen).tolist()
    groups = padding_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(40))
    for group in groups:
        sizes = [lengths[i] for i in group]
        assert len(sizes) * max(sizes) - sum(sizes) <= PAD_WASTE_TOKENS


def test_a_chunk_that_samples_nothing_skips_the_head(tiny: Any) -> None:
    """``heads``: a prefill chunk short of its prompt's end gets no logits, and its
    session goes on exactly as if it had (its KV holds the chunk)."""
    _, folder, _ = tiny
    stage = load_stage(folder, 0, 6)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen) for n in (12, 12)]
    skipped, full = [stage.new_kv() for _ in prompts], [stage.new_kv() for _ in prompts]
    got = stage.forward_batch(
        list(zip(prompts, skipped, strict=True)), last_only=True, heads=[True, False]
    )
    want = stage.forward_batch(list(zip(prompts, full, strict=True)), last_only=True)
    # the head ran over one row here and two there: an fp32 product's last bits depend on
    # its row count on some CPUs (AVX-512/AMX oneDNN; docs/weights.md, "Exactness"), so the
    # logits agree to rounding; the KV they leave behind is compared exactly below
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))
    assert got[1].shape == (0, stage.vocab_size)
    assert [kv.length for kv in skipped] == [12, 12]
    step = torch.tensor([7])
    assert torch.equal(stage.forward(step, skipped[1]), stage.forward(step, full[1]))
    with pytest.raises(InvalidRequest, match="head flags"):
        stage.forward_batch([(step, skipped[0])], heads=[True, False])


def test_a_prefill_split_between_two_copies_of_a_stage_matches_one(tiny: Any) -> None:
    """``spans``: a helper runs units [0, 3) of each chunk, the stage units [3, 6) on its
    hidden states, then takes the helper's KV of layers [0, 2) (export/fill): the logits
    and every decode step after are exactly the unsplit stage's."""
    _, folder, _ = tiny
    main, helper = load_stage(folder, 0, 6), load_stage(folder, 0, 6)
    whole = load_stage(folder, 0, 6)
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(4, VOCAB, (40,), generator=gen)
    kv_main, kv_helper, kv_whole = main.new_kv(), helper.new_kv(), whole.new_kv()
    first = helper.layer_slice(0, 3)
    assert (first.start, first.stop) == (0, 2)
    for chunk in torch.split(prompt, 16):
        hidden = helper.forward_batch([(chunk, kv_helper)], spans=[(0, 3)])[0]
        assert hidden.shape == (chunk.shape[0], helper.hidden_size)
        got = main.forward_batch([(hidden, kv_main)], last_only=True, spans=[(3, 6)])[0]
        want = whole.forward(chunk, kv_whole, last_only=True)
        assert torch.equal(got, want)
    keys, values = kv_helper.export(first, start=16)
    assert keys.shape[0] == 2
    assert keys.shape[2] == 24
    kv_main.fill(0, 16, keys, values)
    keys, values = kv_helper.export(first, start=0)
    kv_main.fill(0, 0, keys[:, :, :16], values[:, :, :16])
    step = torch.tensor([5])
    for _ in range(3):
        got = main.forward(step, kv_main)
        assert torch.equal(got, whole.forward(step, kv_whole))
        step = got[-1:].argmax(-1)
    with pytest.raises(InvalidRequest, match="not within stage"):
        main.forward_batch([(step, kv_main)], spans=[(3, 7)])
    with pytest.raises(InvalidRequest, match="take hidden states"):
        main.forward_batch([(step, kv_main)], spans=[(3, 6)])
    with pytest.raises(InvalidRequest, match="not all held"):
        kv_main.fill(5, 0, keys, values)
    with pytest.raises(InvalidRequest, match="not within the"):
        kv_main.fill(0, kv_main.capacity, keys[:, :, :1], values[:, :, :1])


def test_a_split_layer_left_unfilled_changes_the_next_step(tiny: Any) -> None:
    """The helper's KV matters: without it the stage's decode differs (the test above
    would pass vacuously if the main stage ran every layer itself)."""
    _, folder, _ = tiny
    main, helper, whole = (load_stage(folder, 0, 6) for _ in range(3))
    prompt = torch.randint(4, VOCAB, (20,), generator=torch.Generator().manual_seed(4))
    kv_main, kv_helper, kv_whole = main.new_kv(), helper.new_kv(), whole.new_kv()
    hidden = helper.forward_batch([(prompt, kv_helper)], spans=[(0, 3)])[0]
    main.forward_batch([(hidden, kv_main)], spans=[(3, 6)])
    whole.forward(prompt, kv_whole)
    step = torch.tensor([6])
    assert not torch.equal(main.forward(step, kv_main), whole.forward(step, kv_whole))
