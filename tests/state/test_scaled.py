"""ScaledTensor: the scales' description derived from the data's, and the refusals (issue 32, part A)."""

from __future__ import annotations

import pytest
import torch

import reshard
from reshard import ShardedTensor, ShardingError, StateDictError
from reshard.state.scaled import ScaledTensor
from reshard.state.statedict import flatten_state_dict

pytestmark = pytest.mark.unit

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
FP4 = torch.float4_e2m1fn_x2


def _boxes(st: ShardedTensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(p.box.offset, p.box.shape) for p in st.pieces()]


def test_exported_as_reshard_scaledtensor() -> None:
    assert reshard.ScaledTensor is ScaledTensor


def test_plain_box_128x128_blocks() -> None:
    data = ShardedTensor("w", torch.zeros(128, 256, dtype=E4M3), (512, 512), (256, 256))
    st = ScaledTensor(data, torch.ones(1, 2), "fp8_e4m3", (128, 128))
    assert st.scale_sharded.global_shape == (4, 4)
    assert _boxes(st.scale_sharded) == [((2, 2), (1, 2))]
    assert st.scale_sharded.is_main_replica


@pytest.mark.parametrize(("axis", "expect_offset", "expect_shape"), [(0, (2, 0), (2, 4)), (1, (0, 2), (4, 2))])
def test_from_rank_offsets_on_either_axis(
    axis: int, expect_offset: tuple[int, int], expect_shape: tuple[int, int]
) -> None:
    shape = (256, 512) if axis == 0 else (512, 256)
    data = ShardedTensor.from_rank_offsets("w", torch.zeros(shape, dtype=E4M3), (axis, 1, 2))
    st = ScaledTensor(data, torch.ones(expect_shape), "fp8_e4m3", (128, 128))
    assert st.scale_sharded.global_shape == (4, 4)
    assert _boxes(st.scale_sharded) == [(expect_offset, expect_shape)]


def test_segmented_fused_qkv_scales_follow_their_segments() -> None:
    # global [Q; K; V] of 512 rows each, TP rank 1 of 2 holds rows [256, 512) of each: three segments
    segments = [(256, 256), (768, 256), (1280, 256)]
    data = ShardedTensor.segmented("qkv", torch.zeros(768, 128, dtype=E4M3), (1536, 128), 0, segments)
    st = ScaledTensor(data, torch.ones(6, 1), "fp8_e4m3", (128, 128))
    assert st.scale_sharded.segments == ((2, 2), (6, 2), (10, 2))
    assert _boxes(st.scale_sharded) == [((2, 0), (2, 1)), ((6, 0), (2, 1)), ((10, 0), (2, 1))]


def test_segment_cutting_a_block_is_refused() -> None:
    data = ShardedTensor.segmented("qkv", torch.zeros(192, 128, dtype=E4M3), (384, 128), 0, [(64, 192)])
    with pytest.raises(ShardingError, match=r"'qkv'.*axis 0.*block of 128"):
        ScaledTensor(data, torch.ones(2, 1), "fp8_e4m3", (128, 128))


def test_padding_pads_the_scales() -> None:
    # vocabulary 300 padded to 320, TP rank 1 of 2 holds rows [160, 320) with blocks of 32 rows
    data = ShardedTensor.from_rank_offsets("emb", torch.zeros(160, 64, dtype=E4M3), (0, 1, 2), logical_shape=(300, 64))
    st = ScaledTensor(data, torch.ones(5, 1), "fp8_e4m3", (32, None))
    assert st.scale_sharded.global_shape == (10, 1)
    assert st.scale_sharded.logical_shape == (10, 1)
    assert _boxes(st.scale_sharded) == [((5, 0), (5, 1))]
    data = ShardedTensor.from_rank_offsets("emb", torch.zeros(64, 64, dtype=E4M3), (0, 4, 5), logical_shape=(300, 64))
    st = ScaledTensor(data, torch.ones(2, 1), "fp8_e4m3", (32, None))
    assert st.scale_sharded.logical_shape == (10, 1)
    assert _boxes(st.scale_sharded) == [((8, 0), (2, 1))]


def test_end_of_axis_may_end_inside_a_block() -> None:
    data = ShardedTensor("w", torch.zeros(72, 16, dtype=E4M3), (200, 16), (128, 0))
    st = ScaledTensor(data, torch.ones(1, 1), "fp8_e4m3", (128, None))
    assert _boxes(st.scale_sharded) == [((1, 0), (1, 1))]


def test_per_tensor_scale_0d_is_a_view_held_by_the_origin_rank() -> None:
    scale = torch.tensor(2.0)
    first = ScaledTensor(
        ShardedTensor.from_rank_offsets("w", torch.zeros(4, 8, dtype=E4M3), (0, 0, 2)), scale, "fp8_e4m3"
    )
    other = ScaledTensor(
        ShardedTensor.from_rank_offsets("w", torch.zeros(4, 8, dtype=E4M3), (0, 1, 2)), scale, "fp8_e4m3"
    )
    assert first.scale_sharded.data.shape == (1, 1)
    assert first.scale_sharded.data.data_ptr() == scale.data_ptr()
    assert first.scale_sharded.is_main_replica and not other.scale_sharded.is_main_replica
    assert _boxes(first.scale_sharded) == _boxes(other.scale_sharded) == [((0, 0), (1, 1))]


def test_per_row_scale_replicated_along_the_split_columns() -> None:
    left = ScaledTensor(
        ShardedTensor.from_rank_offsets("w", torch.zeros(8, 4, dtype=E4M3), (1, 0, 2)),
        torch.ones(8, 1),
        "fp8_e4m3",
        (1, None),
    )
    right = ScaledTensor(
        ShardedTensor.from_rank_offsets("w", torch.zeros(8, 4, dtype=E4M3), (1, 1, 2)),
        torch.ones(8, 1),
        "fp8_e4m3",
        (1, None),
    )
    assert _boxes(left.scale_sharded) == _boxes(right.scale_sharded) == [((0, 0), (8, 1))]
    assert left.scale_sharded.is_main_replica and not right.scale_sharded.is_main_replica


def test_a_block_as_long_as_its_axis_is_recorded_as_the_whole_axis_on_every_layout() -> None:
    """A (256, 128) weight with 128x128 blocks: its columns are one block, the same scale along them as a
    per-row-block scale; a whole tensor and a column shard record the same block (a torchao slice shows its own
    length as the block), so a load on another layout compares equal records."""
    whole = ScaledTensor(
        ShardedTensor("w", torch.zeros(256, 128, dtype=E4M3), (256, 128), (0, 0)),
        torch.ones(2, 1),
        "fp8_e4m3",
        (128, 128),
    )
    shard = ScaledTensor(
        ShardedTensor.from_rank_offsets("w", torch.zeros(256, 64, dtype=E4M3), (1, 1, 2)),
        torch.ones(2, 1),
        "fp8_e4m3",
        (128, 128),
    )
    assert whole.block == shard.block == (128, None)
    assert whole.record == shard.record
    assert not shard.scale_sharded.is_main_replica  # the column split shares the one scale along the row block
    empty = ScaledTensor(
        ShardedTensor("e", torch.zeros(0, 4, dtype=E4M3), (0, 4), (0, 0)), torch.ones(0, 1), "fp8_e4m3", (128, 128)
    )
    assert empty.block == (128, None)  # an empty axis keeps its block: no scale cells along it


def test_mxfp8_blocks_of_32_on_the_last_axis() -> None:
    data = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 64, dtype=E4M3), (1, 1, 2))
    st = ScaledTensor(data, torch.zeros(4, 2, dtype=E8M0), "mxfp8_e4m3")
    assert st.block == (1, 32)
    assert _boxes(st.scale_sharded) == [((0, 2), (4, 2))]
    assert st.scale_sharded.data.dtype == torch.uint8  # stored as the bytes of the E8M0 scales


@pytest.mark.parametrize("dtype", [torch.uint8, FP4])
def test_nvfp4_packed_data_blocks_in_bytes_and_global_scale(dtype: torch.dtype) -> None:
    # 64 logical elements per row = 32 bytes; blocks of 16 elements = 8 bytes; TP rank 1 of 2 on the last axis
    data = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 16, dtype=dtype), (1, 1, 2))
    st = ScaledTensor(data, torch.zeros(4, 2, dtype=E4M3), "nvfp4", global_scale=torch.ones(1))
    assert st.scale_sharded.global_shape == (4, 4)
    assert _boxes(st.scale_sharded) == [((0, 2), (4, 2))]
    parts = st.parts()
    assert [p.key for p in parts] == ["w", "w:scale", "w:global_scale"]
    assert parts[0].data.dtype == torch.uint8 and parts[0].data.data_ptr() == data.data.data_ptr()
    assert parts[2].global_shape == () and not parts[2].is_main_replica  # rank 1 does not hold the origin


def test_mxfp4_split_inside_a_block_names_axis_and_block() -> None:
    data = ShardedTensor("w", torch.zeros(4, 8, dtype=torch.uint8), (4, 32), (0, 8))
    with pytest.raises(ShardingError, match=r"'w'.*axis 1.*block of 32 elements"):
        ScaledTensor(data, torch.zeros(4, 1, dtype=E8M0), "mxfp4")


def test_wrong_local_scale_shape_is_refused() -> None:
    data = ShardedTensor("w", torch.zeros(256, 256, dtype=E4M3), (256, 256), (0, 0))
    with pytest.raises(ShardingError, match=r"'w'.*local scale has shape \[2, 1\].*need \[2, 2\]"):
        ScaledTensor(data, torch.ones(2, 1), "fp8_e4m3", (128, 128))


@pytest.mark.parametrize(
    ("data_dtype", "scale_dtype", "fmt", "what"),
    [
        (torch.bfloat16, torch.float32, "fp8_e4m3", "data"),
        (torch.float8_e5m2, torch.float32, "fp8_e4m3", "data"),
        (E4M3, torch.bfloat16, "fp8_e4m3", "scales"),
        (E4M3, torch.float32, "mxfp8_e4m3", "scales"),
        (E4M3, E8M0, "nvfp4", "data"),
    ],
)
def test_wrong_dtypes_for_the_format_are_refused(
    data_dtype: torch.dtype, scale_dtype: torch.dtype, fmt: str, what: str
) -> None:
    data = ShardedTensor("w", torch.zeros(4, 32, dtype=data_dtype), (4, 32), (0, 0))
    with pytest.raises(ShardingError, match=rf"'w'.*{fmt}.*{what}"):
        ScaledTensor(
            data, torch.zeros(4, 1, dtype=scale_dtype), fmt, global_scale=torch.ones(1) if "nv" in fmt else None
        )


def test_flat_range_unknown_format_and_global_scale_refusals() -> None:
    flat = ShardedTensor.from_flat_range("w", torch.zeros(8, dtype=E4M3), (4, 4), (4, 4), (0, 0), 0, 8)
    with pytest.raises(ShardingError, match="flat range"):
        ScaledTensor(flat, torch.ones(()), "fp8_e4m3")
    data = ShardedTensor("w", torch.zeros(4, 32, dtype=torch.uint8), (4, 32), (0, 0))
    with pytest.raises(ShardingError, match="unknown low-precision format"):
        ScaledTensor(data, torch.ones(()), "fp7")
    with pytest.raises(ShardingError, match="needs a global_scale"):
        ScaledTensor(data, torch.zeros(4, 4, dtype=E4M3), "nvfp4")
    with pytest.raises(ShardingError, match="has no global scale"):
        ScaledTensor(data, torch.zeros(4, 2, dtype=E8M0), "mxfp4", global_scale=torch.ones(1))


def test_flatten_refuses_byte_only_dtypes_outside_a_scaled_tensor_and_clashing_keys() -> None:
    with pytest.raises(StateDictError, match=r"only as the data or scales of a reshard\.ScaledTensor"):
        flatten_state_dict({"w": torch.zeros(2, 2, dtype=FP4)}, rank=0)
    st = ScaledTensor(ShardedTensor("w", torch.zeros(2, 2, dtype=E4M3), (2, 2), (0, 0)), torch.ones(()), "fp8_e4m3")
    with pytest.raises(StateDictError, match="w:scale"):
        flatten_state_dict({"w": st, "w:scale": torch.ones(1, 1)}, rank=0)
    flat = flatten_state_dict({"w": st}, rank=0)
    assert [t.key for t in flat.tensors] == ["w", "w:scale"]
    assert flat.scaled["w"].format == "fp8_e4m3" and flat.scaled["w"].block == (None, None)
