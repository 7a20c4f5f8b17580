"""reshard.geometry.sorting.lexsort gives numpy.lexsort's order exactly, packed, partly packed or not at all; the
overlap sweep of reshard.geometry.tiling finds what comparing every pair finds."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.geometry.sorting import lexsort

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("seed", range(20))
def test_lexsort_matches_numpy_on_random_keys_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    keys = [rng.integers(-5, int(rng.integers(1, 6)), n) for _ in range(int(rng.integers(1, 5)))]
    assert np.array_equal(lexsort(keys), np.lexsort(keys))


def test_lexsort_packs_what_fits_and_sorts_the_rest_as_numpy_does() -> None:
    rng = np.random.default_rng(7)
    wide = rng.integers(-(1 << 61), 1 << 61, 500)  # too wide to pack with anything
    small = rng.integers(0, 3, 500)
    for keys in ([small, wide], [wide, small], [wide, wide % 7, small], [small == 1, small]):
        assert np.array_equal(lexsort(keys), np.lexsort(keys))


def test_lexsort_of_nothing() -> None:
    assert lexsort([np.zeros(0, dtype=np.int64)]).tolist() == []
    with pytest.raises(ValueError):
        lexsort([])


@pytest.mark.parametrize("seed", range(30))
def test_first_overlap_finds_an_overlap_exactly_when_two_boxes_share_an_element(seed: int) -> None:
    """The sweep of reshard.geometry.tiling.first_overlap against every pair (what read-once scheduling compared
    before: quadratic in the distinct boxes of a key, 20 s of a 1024-rank schedule)."""
    from reshard.geometry.boxes import Box
    from reshard.geometry.tiling import first_overlap

    rng = np.random.default_rng(seed)
    ndim = int(rng.integers(1, 4))
    boxes = []
    for _ in range(int(rng.integers(0, 12))):
        offset = tuple(int(v) for v in rng.integers(0, 6, ndim))
        shape = tuple(int(v) for v in rng.integers(0, 4, ndim))
        boxes.append(Box(offset, shape))
    pairs = [
        (i, j)
        for i in range(len(boxes))
        for j in range(i + 1, len(boxes))
        if boxes[i].volume and boxes[j].volume and boxes[i].intersect(boxes[j]) is not None
    ]
    found = first_overlap(boxes)
    assert (found is None) == (not pairs)
    if found is not None:
        assert found in pairs
