"""Precomputed teacher logits: the top k per token written once (all or nothing), checked, streamed into the KL."""

import json

import pytest
import torch

from modelopt_moe.distill import (
    DistillationModel,
    LogitStoreError,
    StoredTeacherLogits,
    TeacherLogitsStore,
    TeacherLogitsWriter,
    logits_kl_loss,
)

VOCAB, K = 80, 12


class TinyLM(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding, self.out = torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, VOCAB)

    def forward(self, tokens):
        return self.out(torch.tanh(self.embedding(tokens))) * 3


BATCHES = [torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(i)) for i in range(5)]


def _write(path, teacher, batches=BATCHES, dtype=torch.float32, per_shard=2):
    writer = TeacherLogitsWriter(path, top_k=K, values_dtype=dtype, batches_per_shard=per_shard)
    with torch.no_grad():
        for tokens in batches:
            writer.add(tokens, teacher(tokens))
    return writer.commit()


def test_store_holds_the_top_k_in_shards_and_the_kl_from_it_is_the_live_top_k_kl(tmp_path):
    teacher = TinyLM(1)
    path = _write(tmp_path / "store", teacher)
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "shard-00000.pt", "shard-00001.pt",
                                                      "shard-00002.pt"]
    assert (manifest["top_k"], manifest["vocab_size"], manifest["batches"]) == (K, VOCAB, 5)
    assert [p.name for p in tmp_path.iterdir()] == ["store"]  # no temporary directory left
    store = TeacherLogitsStore(path, top_k=K, vocab_size=VOCAB, batches=BATCHES)
    values, ids = store.batch(3)
    live = teacher(BATCHES[3]).detach()
    assert ids.dtype == torch.int32
    assert torch.equal(values, live.topk(K).values)
    assert torch.equal(live.gather(-1, ids.long()), values)
    stored = StoredTeacherLogits(store)
    resumed = StoredTeacherLogits(store, start_batch=7)  # 7 micro-batches done: the third of the second epoch
    assert torch.equal(resumed(BATCHES[2]), stored(BATCHES[0]).new_full((2, 9, VOCAB), float("-inf")).scatter(
        -1, store.batch(2)[1].long(), store.batch(2)[0]))
    stored.position = 0
    for epoch in range(2):  # cycles: a second epoch reads the store again
        for tokens in BATCHES:
            s = torch.randn(2, 9, VOCAB, generator=torch.Generator().manual_seed(epoch)).requires_grad_(True)
            s_live = s.detach().clone().requires_grad_(True)
            kl = logits_kl_loss(s, stored(tokens), top_k=K, temperature=2.0)
            kl_live = logits_kl_loss(s_live, teacher(tokens).detach(), top_k=K, temperature=2.0)
            kl.sum().backward()
            kl_live.sum().backward()
            assert torch.equal(kl, kl_live)  # the same numbers: values stored in the logits' dtype
            assert torch.equal(s.grad, s_live.grad)


def test_distillation_model_from_the_store_equals_the_live_teacher_top_k(tmp_path):
    teacher, student = TinyLM(1), TinyLM(2)
    store = TeacherLogitsStore(_write(tmp_path / "store", teacher))
    from_store = DistillationModel(student, StoredTeacherLogits(store), temperature=1.5)
    live = DistillationModel(student, teacher, temperature=1.5, top_k=K)
    assert from_store.top_k == K  # the store's k
    for tokens in BATCHES:
        assert torch.equal(from_store(tokens), live(tokens))
    with pytest.raises(ValueError, match=r"top_k=4 but the stored teacher logits .* hold the top 12"):
        DistillationModel(student, StoredTeacherLogits(store), top_k=4)
    with pytest.raises(ValueError, match=r"teacher_fp8='per_tensor' with stored teacher logits"):
        DistillationModel(student, StoredTeacherLogits(store), teacher_fp8="per_tensor")
    with pytest.raises(ValueError, match=r"top_p=0.9 with stored teacher logits .* hold the teacher's top 12"):
        DistillationModel(student, StoredTeacherLogits(store), top_p=0.9)


def test_logits_tied_with_the_kth_are_stored_as_the_live_top_k_keeps_them(tmp_path):
    # bf16 logits on a coarse grid: many tokens have several logits equal to their k-th largest
    g = torch.Generator().manual_seed(3)
    logits = [(torch.randn(2, 9, VOCAB, generator=g) * 2).round().div(2).bfloat16() for _ in BATCHES]
    writer = TeacherLogitsWriter(tmp_path / "store", top_k=K)  # bf16 values: the default
    for tokens, t in zip(BATCHES, logits, strict=True):
        writer.add(tokens, t)
    store = TeacherLogitsStore(writer.commit())
    assert max(store.batch(i)[0].shape[-1] for i in range(len(BATCHES))) > K  # ties widen the rows
    stored = StoredTeacherLogits(store)
    for tokens, t in zip(BATCHES, logits, strict=True):
        s = torch.randn(2, 9, VOCAB, generator=g).bfloat16()
        s1, s2 = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
        kl, kl_live = logits_kl_loss(s1, stored(tokens), top_k=K), logits_kl_loss(s2, t, top_k=K)
        (kl.sum() + kl_live.sum()).backward()
        assert torch.equal(kl, kl_live)
        assert torch.equal(s1.grad, s2.grad)


def test_bf16_values_and_int32_ids_take_6_bytes_a_token_and_a_tensor_parallel_slice_reads_its_ids(tmp_path):
    teacher = TinyLM(1)
    store = TeacherLogitsStore(_write(tmp_path / "store", teacher, dtype=torch.bfloat16, per_shard=5))
    values, _ = store.batch(0)
    assert values.dtype == torch.bfloat16
    tokens = sum(b.numel() for b in BATCHES)
    assert store.manifest["shards"][0]["bytes"] < 6 * K * tokens + 8192  # the payload and torch.save's framing
    full = StoredTeacherLogits(store)(BATCHES[0])
    half = StoredTeacherLogits(store, vocab_first=VOCAB // 2, vocab_slice=VOCAB // 2)
    half.position = 0
    assert torch.equal(half(BATCHES[0]), full[..., VOCAB // 2:])
    assert torch.isfinite(full).sum(-1).eq(K).all()  # k finite values a token, -inf elsewhere


def test_a_failed_write_leaves_the_old_store_and_a_foreign_directory_is_refused_before_the_teacher_runs(tmp_path):
    teacher = TinyLM(1)
    path = _write(tmp_path / "store", teacher)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    writer = TeacherLogitsWriter(path, top_k=K)
    writer.add(BATCHES[0], teacher(BATCHES[0]).detach())
    with pytest.raises(LogitStoreError, match=r"batch 1: vocabulary 40, the batches before had 80"):
        writer.add(BATCHES[1], teacher(BATCHES[1]).detach()[..., :40])
    writer.abort()
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["store"]
    _write(path, teacher, batches=BATCHES[:2])  # a store of ours is replaced whole
    assert TeacherLogitsStore(path).num_batches == 2
    foreign = tmp_path / "checkpoint"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(LogitStoreError, match=r"checkpoint: exists and is not a teacher-logits store"):
        TeacherLogitsWriter(foreign, top_k=K)
    assert (foreign / "model.safetensors").read_bytes() == b"weights"


def test_a_damaged_or_mismatched_store_is_refused_naming_the_file_and_field(tmp_path):
    path = _write(tmp_path / "store", TinyLM(1))
    cases = {
        "k": (dict(top_k=K + 1), r"manifest.json: field 'top_k' is 12, but the run expects 13"),
        "vocab": (dict(vocab_size=VOCAB * 2), r"manifest.json: field 'vocab_size' is 80, but the run expects 160"),
        "order": (dict(batches=BATCHES[::-1]), r"'tokens_sha256\[0\]'.*stored as batch 4: another data order"),
        "tokens": (dict(batches=[b + 1 for b in BATCHES]), r"'tokens_sha256\[0\]'.*another data\)"),
        "count": (dict(batches=BATCHES[:4]), r"field 'batches' is 5, but the run feeds 4 batches"),
    }
    for kwargs, match in cases.values():
        with pytest.raises(LogitStoreError, match=match):
            TeacherLogitsStore(path, **kwargs)
    stored = StoredTeacherLogits(TeacherLogitsStore(path))
    with pytest.raises(LogitStoreError, match=r"'tokens_sha256\[0\]': the tokens of the run's batch 0 differ"):
        stored(BATCHES[1])
    shard = path / "shard-00001.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(LogitStoreError, match=r"shard-00001.pt: \d+ bytes; the manifest's field 'shards' records"):
        TeacherLogitsStore(path)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "shards": [{"file": "shard-00000.pt"}]}))
    with pytest.raises(LogitStoreError, match=r"field 'shards' is damaged \(KeyError: 'first'\)"):
        TeacherLogitsStore(path)
    with pytest.raises(LogitStoreError, match=r"no batch was added; nothing to write"):
        TeacherLogitsWriter(tmp_path / "empty", top_k=K).commit()
    assert not (tmp_path / "empty").exists()
    (path / "manifest.json").write_text(json.dumps({"format": "something else", "version": 1}))
    with pytest.raises(LogitStoreError, match=r"format/version \('something else', 1\)"):
        TeacherLogitsStore(path)
