"""train.sampler=documents: every row starts at a document's start, each document once per epoch; the targets
past its end (its end-of-document id included as the last that carries loss) carry none."""

import numpy as np
import pytest
import torch

from rwkvx_cli.data.errors import DataError
from rwkvx_cli.data.sampler import DocumentSampler, document_windows, documents


def _corpus(seed=0, n_docs=40):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 200, size=int(rng.integers(1, 30))).tolist() + [0] for _ in range(n_docs)]
    return docs, np.array(sum(docs, []), dtype=np.uint16)


def test_documents_are_found_between_end_of_document_ids():
    tokens = np.array([5, 6, 0, 0, 7, 0, 8, 9], dtype=np.uint16)  # an empty document, and a last without its eod
    starts, ends = documents(tokens, 0, chunk=3)  # read in pieces that cut documents
    assert starts.tolist() == [0, 4, 6] and ends.tolist() == [2, 5, 7]
    docs, tokens = _corpus()
    starts, ends = documents(tokens, 0, chunk=7)
    assert [tokens[s : e + 1].tolist() for s, e in zip(starts, ends, strict=True)] == docs


def test_each_document_once_per_epoch_from_its_start_with_loss_inside_it_alone():
    docs, tokens = _corpus()
    mask = (np.arange(len(tokens)) % 3 != 0).astype(np.uint8)
    ctx = 16
    sampler = DocumentSampler(tokens, 0, ctx, batch_size=8, seed=3, masks=mask)
    assert sampler.n_windows == len(docs) == 40
    seen = []
    for step in range(5):  # one epoch: 40 documents in 5 steps of 8
        x, y = sampler.batch(step)
        m, count = sampler.target_masks(step)
        assert count == int(m.sum())
        for row, start in enumerate(sampler.starts(step).tolist()):
            doc = docs[int(np.searchsorted(sampler.doc_starts, start))]
            seen.append(start)
            want = np.asarray(tokens[start : start + ctx + 1], dtype=np.int64)
            n = len(want) - 1
            assert x[row, :n].tolist() == want[:-1].tolist() and y[row, :n].tolist() == want[1:].tolist()
            inside = np.arange(1, ctx + 1) < len(doc)  # targets 1..len(doc)-1 of the document, its eod the last
            expect = inside & (mask[np.minimum(start + np.arange(1, ctx + 1), len(tokens) - 1)] != 0)
            assert m[row].tolist() == expect.tolist()
    assert sorted(seen) == sorted(sampler.doc_starts.tolist())  # every document exactly once
    assert sampler.epoch(5) == 1
    # a rank's rows of the global batch, and the whole batch's count of loss tokens on every rank
    x0, _ = sampler.batch(2, 0, 2)
    m1, count1 = sampler.target_masks(2, 1, 2)
    x, _ = sampler.batch(2)
    m, count = sampler.target_masks(2)
    assert torch.equal(x0, x[0::2]) and torch.equal(m1, m[1::2]) and count1 == count


def test_without_masks_every_target_inside_the_document_carries_loss():
    tokens = np.array([3, 4, 5, 0, 6, 0], dtype=np.uint16)
    sampler = DocumentSampler(tokens, 0, 4, batch_size=2, seed=0)
    m, count = sampler.target_masks(0)
    by_start = dict(zip(sampler.starts(0).tolist(), m.tolist(), strict=True))
    assert by_start == {0: [True, True, True, False], 4: [True, False, False, False]} and count == 4


def test_evaluation_reads_each_document_of_the_range_alone():
    docs, tokens = _corpus(seed=1, n_docs=10)
    windows = list(document_windows(tokens, 0, 8, max_tokens=len(docs[0]) + 1))  # the first two documents
    assert len(windows) == 2
    for (x, y, m, n), doc in zip(windows, docs, strict=False):
        assert n == min(len(doc) - 1, 8) and int(m.sum()) == n
        assert x[0, :n].tolist() == doc[:n] and y[0, :n].tolist() == doc[1 : n + 1]


def test_a_split_without_a_document_to_predict_is_one_line():
    with pytest.raises(DataError, match="no document with a token to predict"):
        DocumentSampler(np.array([0, 0, 0], dtype=np.uint16), 0, 4, 2)
