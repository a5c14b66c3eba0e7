"""`api/jobs.py`'s checks on a sample's target_prompt_logprobs tensor, without a server: what the SDK builds
parses to the ids and layout it means, and each malformed tensor is refused with one line naming the problem.

Reference: the `tinker==0.38.0` SDK's own `TensorData.from_torch` / `from_torch_sparse(pad_value=-1)` (its
docstring's recipe for targets) and torch's CSR layout.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from inflight.api.jobs import prompt_targets
from inflight.api.schemas import TensorData
from inflight.errors import UserError

tinker_types = pytest.importorskip("tinker.types")
VOCAB = 50


def wire(tensor: Any) -> TensorData:
    """The SDK's TensorData as this server parses it from the request's JSON (the SDK's own conversion)."""
    from tinker.lib.public_interfaces.sampling_client import _tensor_data_to_model

    return TensorData.model_validate(_tensor_data_to_model(tensor).model_dump(mode="json"))


def test_dense_and_sparse_tensors_from_the_sdk_mean_the_same_ids() -> None:
    ids = torch.full((5, 4), -1, dtype=torch.int64)
    ids[1, 2], ids[3, 0], ids[3, 3] = 7, 0, 49
    dense = prompt_targets(wire(tinker_types.TensorData.from_torch(ids)), 6, VOCAB, 8)
    sparse_sent = tinker_types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert sparse_sent.sparse_crow_indices is not None  # sparse is smaller here, so the SDK sends CSR
    sparse = prompt_targets(wire(sparse_sent), 6, VOCAB, 8)
    assert dense.ids == sparse.ids == ids.tolist() and dense.layout is None
    assert sparse.layout is not None
    assert sparse.layout.crow_indices == sparse_sent.sparse_crow_indices
    assert sparse.layout.col_indices == sparse_sent.sparse_col_indices


def csr(crow: list[int], col: list[int], data: list[float], shape: list[int]) -> TensorData:
    return TensorData(data=data, dtype="int64", shape=shape, sparse_crow_indices=crow, sparse_col_indices=col)


@pytest.mark.parametrize(
    "tensor,message",
    [
        (TensorData(data=[1.0] * 4, dtype="float32", shape=[4, 1]), "must be an int64 tensor"),
        (TensorData(data=[1.0] * 4, dtype="int64", shape=[4]), r"must be 2-D, \[len\(prompt\) - 1, K\]"),
        (TensorData(data=[1.0] * 3, dtype="int64", shape=[3, 1]), "has 3 rows; .* needs len"),
        (TensorData(data=[1.0] * 36, dtype="int64", shape=[4, 9]), "has 9 columns; this server takes 1 to 8"),
        (TensorData(data=[1.0] * 3, dtype="int64", shape=[4, 1]), r"declares shape \[4, 1\] but holds 3"),
        (TensorData(data=[1.5, 1, 1, 1], dtype="int64", shape=[4, 1]), "holds 1.5; ids must lie"),
        (TensorData(data=[math.nan, 1, 1, 1], dtype="int64", shape=[4, 1]), "holds nan; ids must lie"),
        (TensorData(data=[-2.0, 1, 1, 1], dtype="int64", shape=[4, 1]), "holds -2; ids must lie"),
        (TensorData(data=[-1.0] * 4, dtype="int64", shape=[4, 1]), "names no token id"),
        (
            TensorData(data=[1.0], dtype="int64", shape=[4, 2], sparse_crow_indices=[0, 1, 1, 1, 1]),
            "needs both sparse_crow_indices and sparse_col_indices",
        ),
        (csr([0, 1, 1, 1], [0], [3.0], [4, 2]), "must hold rows \\+ 1 = 5 offsets"),
        (csr([0, 2, 1, 2, 2], [0, 1], [3.0, 4.0], [4, 2]), "row 1 of the sparse tensor is malformed"),
        (csr([0, 1, 1, 1, 1], [2], [3.0], [4, 2]), "row 0 of the sparse tensor is malformed"),
        (csr([0, 2, 2, 2, 2], [1, 1], [3.0, 4.0], [4, 2]), "row 0 of the sparse tensor is malformed"),
        (csr([0, 1, 1, 1, 1], [0], [-1.0], [4, 2]), "names no token id"),
    ],
)
def test_malformed_targets_are_refused_naming_the_problem(tensor: TensorData, message: str) -> None:
    with pytest.raises(UserError, match=f"^target_prompt_logprobs.*{message}") as refused:
        prompt_targets(tensor, 5, VOCAB, 8)
    assert "\n" not in str(refused.value)
