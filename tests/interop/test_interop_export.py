"""``reshard export``: Hugging Face sharded safetensors, checked with the ``safetensors`` library; and the
memory bound of a streamed export, measured in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import reshard
from reshard.cli import main
from reshard.errors import CheckpointExistsError, MismatchError, StateDictError
from reshard.interop import export_safetensors

FULL = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 8


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint whose ``layer.weight`` is stored as two column boxes (strided reads to reassemble it),
    plus tensors of several dtypes, an object and common values. Returns the full tensors by key."""
    state = {
        "left": reshard.ShardedTensor("layer.weight", FULL[:, :3].clone(), (4, 6), (0, 0)),
        "right": reshard.ShardedTensor("layer.weight", FULL[:, 3:].clone(), (4, 6), (0, 3)),
        "layer": {"bias": torch.linspace(-1, 1, 6, dtype=torch.bfloat16)},
        "embed": torch.arange(40, dtype=torch.float64).reshape(8, 5),
        "counts": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.5),
        "rng": reshard.ShardedObject("rng", {"seed": 3}, (1,), (0,)),
        "step": 9,
    }
    reshard.save(state, path, options=reshard.SaveOptions(checksum_chunk_bytes=16))
    return {
        "layer.weight": FULL,
        "layer.bias": state["layer"]["bias"],
        "embed": state["embed"],
        "counts": state["counts"],
        "mask": state["mask"],
        "scale": state["scale"],
    }


def _load_export(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded = load_file(out / name)
        assert all(index["weight_map"][k] == name for k in loaded)
        with safe_open(out / name, framework="pt") as handle:
            assert handle.metadata()["format"] == "pt"
        tensors.update(loaded)
    return tensors, index


@pytest.mark.unit
def test_export_shards_index_and_values(tmp_path: Path) -> None:
    expected = _checkpoint(tmp_path / "ckpt")
    result = export_safetensors(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=200)
    tensors, index = _load_export(tmp_path / "hf")
    assert set(tensors) == set(expected)
    for key, value in expected.items():
        assert tensors[key].dtype == value.dtype and torch.equal(tensors[key], value), key
    total = sum(v.numel() * v.element_size() for v in expected.values())
    assert index["metadata"]["total_size"] == total == result.total_bytes
    # 320 bytes of embed exceed the limit alone; the others are split so no shard exceeds 200 bytes otherwise.
    sizes: dict[str, int] = {}
    for key, name in index["weight_map"].items():
        sizes[name] = sizes.get(name, 0) + expected[key].numel() * expected[key].element_size()
    assert len(result.files) == len(sizes) >= 3
    assert all(size <= 200 or size == 320 for size in sizes.values())
    assert result.files == tuple(f"model-{i:05d}-of-{len(sizes):05d}.safetensors" for i in range(1, len(sizes) + 1))
    assert result.not_tensors == 2  # the object and the common value


@pytest.mark.unit
def test_export_casts_floating_tensors_and_maps_keys(tmp_path: Path) -> None:
    expected = _checkpoint(tmp_path / "ckpt")
    key_map = {"layer.weight": "model.w", "embed": None}
    result = export_safetensors(tmp_path / "ckpt", tmp_path / "hf", key_map=key_map, dtype=torch.bfloat16)
    tensors, _ = _load_export(tmp_path / "hf")
    assert set(tensors) == {"model.w", "layer.bias", "counts", "mask", "scale"}
    assert result.left_out == ("embed",)
    assert tensors["model.w"].dtype == torch.bfloat16 and torch.equal(tensors["model.w"], FULL.bfloat16())
    assert tensors["scale"].dtype == torch.bfloat16
    assert tensors["counts"].dtype == torch.int64 and torch.equal(tensors["counts"], expected["counts"])
    assert tensors["mask"].dtype == torch.bool
    with pytest.raises(MismatchError, match="'nope'"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "hf2", key_map={"nope": "x"})
    with pytest.raises(StateDictError, match="both be exported as 'x'"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "hf2", key_map=lambda key: "x")
    assert not (tmp_path / "hf2").exists() or not any((tmp_path / "hf2").iterdir())


@pytest.mark.unit
def test_export_refuses_an_earlier_export_unless_overwrite(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "hf"
    first = export_safetensors(tmp_path / "ckpt", out, max_shard_bytes=100)
    (out / "config.json").write_text("{}")
    with pytest.raises(CheckpointExistsError, match="already holds"):
        export_safetensors(tmp_path / "ckpt", out)
    second = export_safetensors(tmp_path / "ckpt", out, overwrite=True)
    assert len(first.files) > 1 and second.files == ("model-00001-of-00001.safetensors",)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*second.files, "model.safetensors.index.json", "config.json"]
    )


@pytest.mark.unit
def test_export_cli_with_key_map_file_and_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _checkpoint(tmp_path / "ckpt")
    key_map = tmp_path / "map.json"
    key_map.write_text(json.dumps({"layer.weight": "w", "layer.bias": None}))
    code = main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--key-map", str(key_map)])
    code_prefix = main(
        ["export", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--prefix", "layer.", "--dtype", "fp16"]
    )
    out = capsys.readouterr().out
    assert code == 0 and code_prefix == 0
    tensors, _ = _load_export(tmp_path / "hf")
    assert set(tensors) == {"w", "embed", "counts", "mask", "scale"}
    prefixed, _ = _load_export(tmp_path / "hf2")
    assert set(prefixed) == {"weight", "bias"} and prefixed["weight"].dtype == torch.float16
    assert "in 1 safetensors files" in out and "left out by the key map: 1 tensors" in out
    # A prefix no key starts with would export nothing: an error (exit 3) naming the keys' first parts.
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf4"), "--prefix", "model."]) == 3
    assert "would write no tensors" in capsys.readouterr().err and not (tmp_path / "hf4").exists()
    key_map.write_text("[1, 2]")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf3"), "--key-map", str(key_map)]) == 2
    assert "must be a JSON object" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf3"), "--max-shard-size", "lots"])
    assert usage.value.code == 2


_PEAK_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from reshard.interop import export_safetensors

    def status(field):
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field))

    small, big, out = sys.argv[1:4]
    export_safetensors(small, out + "/warmup", dtype=torch.bfloat16)  # code paths and lazy imports, once
    growth = {}
    for name, dtype in (("same", None), ("bf16", torch.bfloat16)):
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # reset the peak (VmHWM) to the current resident size
        before = status("VmRSS:")
        export_safetensors(big, out + "/" + name, dtype=dtype, max_shard_bytes=10 * 2**20)
        growth[name] = status("VmHWM:") - before
    print(json.dumps(growth))
    """
)


@pytest.mark.dist
def test_export_memory_stays_at_one_tensor_not_the_checkpoint(tmp_path: Path) -> None:
    tensor_bytes = 4 * 2**20
    reshard.save({f"t{i}": torch.full((tensor_bytes // 4,), float(i)) for i in range(8)}, tmp_path / "big")
    reshard.save({"t": torch.ones(8)}, tmp_path / "small")
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, str(tmp_path / "small"), str(tmp_path / "big"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    growth = json.loads(done.stdout.splitlines()[-1])
    # The checkpoint holds 32 MiB of tensors; the export may hold one 4 MiB tensor (and, when casting, the
    # mapped source of one tensor) plus buffers, never all of them.
    for name, grew in growth.items():
        assert grew < 2 * tensor_bytes + 4 * 2**20, (name, grew)
    tensors, index = _load_export(tmp_path / "out" / "same")
    assert len(tensors) == 8 and all(torch.all(tensors[f"t{i}"] == i) for i in range(8))
    assert len(set(index["weight_map"].values())) == 4  # two 4 MiB tensors per 10 MiB shard
