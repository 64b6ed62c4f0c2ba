"""Triton's classification extension: the top k as "score:index[:label]", as Triton writes them."""

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from plugserve.registry.errors import InvalidInput
from plugserve.server.triton.classification import class_count, classify
from tests.server.triton.conftest import LABELS


def test_scores_are_formatted_as_triton_does() -> None:
    scores = np.array([0.1, 0.7, 0.2], np.float32)
    assert classify(scores, 2, ["a", "b", "c"]).tolist() == [b"0.700000:1:b", b"0.200000:2:c"]
    assert classify(scores, 1).tolist() == [b"0.700000:1"]  # no labels: score:index
    ints = np.array([[3, 9], [9, 3]], np.int64)
    assert classify(ints, 1, batched=True).tolist() == [[b"9:1"], [b"9:0"]]
    assert classify(ints, 3).tolist() == [b"9:1", b"9:2", b"3:0"]  # unbatched: one over all
    assert classify(np.array([200, 7], np.uint8), 2).tolist() == [b"200:0", b"7:1"]


def test_k_is_clamped_ties_keep_index_order_and_labels_may_run_short() -> None:
    out = classify(np.array([[1.0, 2.0, 2.0]]), 10, ["only"], batched=True)
    assert out.shape == (1, 3)  # 3 classes: k = 10 gives the 3
    assert out.tolist() == [[b"2.000000:1", b"2.000000:2", b"1.000000:0:only"]]


def test_an_empty_batch_has_no_rows_to_classify() -> None:
    """Found by attacking it: a batch of 0 rows was a 500 (numpy cannot reshape it to -1)."""
    out = classify(np.zeros((0, 4), np.float32), 2, batched=True)
    assert out.shape == (0, 2)


def test_what_cannot_be_classified_is_a_400() -> None:
    with pytest.raises(InvalidInput, match="unsupported type 'BYTES'"):
        classify(np.array([b"a"], dtype=object), 1)
    for bad in (-1, 1.5, True, "3", 1 << 21):
        with pytest.raises(InvalidInput, match="'classification' must be an integer"):
            class_count({"classification": bad}, "output 'y'")
    assert class_count({}, "output 'y'") == 0


@pytest.mark.slow
@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_asks_for_the_top_classes(
    triton: httpclient.InferenceServerClient, binary: bool
) -> None:
    x = np.array([[0.1, 0.9, 0.3, 0.0, 0.5], [0.8, 0.0, 0.0, 0.7, 0.2]], np.float32)
    inp = httpclient.InferInput("x", [2, 5], "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    wanted = httpclient.InferRequestedOutput("y", binary_data=binary, class_count=3)
    result = triton.infer("scores", [inp], outputs=[wanted], model_version="1")
    got = result.as_numpy("y")
    assert got.shape == (2, 3)  # per row of the batch
    assert [[v.decode() if isinstance(v, bytes) else v for v in row] for row in got] == [
        [f"0.900000:1:{LABELS[1]}", f"0.500000:4:{LABELS[4]}", f"0.300000:2:{LABELS[2]}"],
        [f"0.800000:0:{LABELS[0]}", f"0.700000:3:{LABELS[3]}", f"0.200000:4:{LABELS[4]}"],
    ]
    # Without batching (max_batch_size 0) the whole tensor is one classification; no labels.
    ints = httpclient.InferInput("in", [2, 3], "INT32")
    ints.set_data_from_numpy(np.array([[1, 5, 2], [0, 4, 3]], np.int32), binary_data=binary)
    outputs = [
        httpclient.InferRequestedOutput("out", binary_data=binary, class_count=10),
        httpclient.InferRequestedOutput("raw", binary_data=binary),
    ]
    result = triton.infer("double", [ints], outputs=outputs)
    top = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("out")]
    assert top == ["10:1", "8:4", "6:5", "4:2", "2:0", "0:3"]  # 10 asked, 6 there: all 6
    assert result.as_numpy("raw").tolist() == [[1, 5, 2], [0, 4, 3]]  # not asked: the tensor


@pytest.mark.slow
def test_a_bad_classification_parameter_is_a_400(triton: httpclient.InferenceServerClient) -> None:
    inp = httpclient.InferInput("x", [1, 5], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 5), np.float32))
    wanted = httpclient.InferRequestedOutput("y", class_count=3)
    wanted._parameters["classification"] = "three"  # what tritonclient would never send
    with pytest.raises(InferenceServerException) as info:
        triton.infer("scores", [inp], outputs=[wanted])
    assert info.value.status() == "400"
    assert "'classification' must be an integer" in info.value.message()
