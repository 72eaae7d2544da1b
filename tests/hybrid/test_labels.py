"""next_token_labels: shifted per document on the full stream, and malformed cu_seqlens refused."""
import pytest
import torch

from cpscope.train._prepare import next_token_labels


def test_next_token_labels_per_document():
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    assert next_token_labels(ids, [0, 3, 3, 6]).tolist() == [6, 7, -100, 9, 10, -100]


@pytest.mark.parametrize(
    "cu, match",
    [([0, 4, 2, 6], "non-decreasing"), ([1, 6], "must start at 0"), ([0, 5], r"cu_seqlens\[-1\]=5"),
     (torch.tensor([0.0, 6.0]), "int32")],
)
def test_next_token_labels_refuses_bad_cu_seqlens(cu, match):
    with pytest.raises(ValueError, match=match):
        next_token_labels(torch.arange(6), cu)
