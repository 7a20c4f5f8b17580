"""``reshard.interop.torchtitan.ReshardCheckpointManager``: torchtitan's debug Llama, parallelized by torchtitan's own
``parallelize_llama`` (FSDP2, TP or both; ``partial_dtensor``, and ``full_dtensor`` untrained) on gloo CPU ranks,
trained a few steps with torchtitan's optimizer and LR scheduler containers, saved through the reshard manager and
resumed at another parallelism: model and optimizer state bit-exact against what was saved and against the same
resume through torchtitan's own DCP manager.

Two things torchtitan 0.3.0 needs on a CPU-only host, set in the ranks (not mocks: torchtitan's real code runs):
``torchtitan.distributed.parallel_dims.device_type`` is chosen at import as the available accelerator or
``"cuda"``, so ``ParallelDims.build_mesh`` fails with ``torch._C has no attribute '_cuda_setDevice'`` unless it
says ``"cpu"``; torchtitan's FSDP sets a gradient divide factor of 1.0, which FSDP2 reduces with
``ReduceOp.PREMUL_SUM``, which gloo refuses (``Cannot use ReduceOp.PREMUL_SUM with Gloo``), so the FSDP modules
are told to reduce with plain sums (``set_force_sum_reduction_for_comms``; the factor is 1.0: same values).
FlexAttention, the debug model's attention, has no backward on CPU, so its layers use torchtitan's
``ScaledDotProductAttention`` (causal, no masks), as torchtitan's own graph-trainer tests do.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan")

import torch
import torch.distributed as dist

from reshard.errors import CheckpointError, CheckpointNotFoundError
from tests.rankpool import RankContext, RankPool

pytestmark = pytest.mark.dist


class TrainState:
    """The trainer's own state as torchtitan's Trainer gives it (``{"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "ntokens_seen": torch.tensor(self.ntokens_seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"].item())
        self.ntokens_seen = int(state["ntokens_seen"].item())


class TinyTokens(torch.utils.data.IterableDataset[torch.Tensor]):
    """A tiny stateful dataset of one data-parallel rank: token ids ``1000 * dp_rank + i`` from its position on
    (torchdata's StatefulDataLoader saves and restores its ``state_dict``)."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank, self.position = dp_rank, 0

    def __iter__(self) -> Any:
        while True:
            self.position += 1
            yield torch.tensor([1000 * self.dp_rank + self.position])

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def _build(
    fsdp: int, tp: int, seed: int, backend: str = "partial_dtensor", sharding: bool = True
) -> tuple[Any, Any, Any]:
    """torchtitan's debug Llama (2 of its 6 layers, for time) parallelized by its own parallelize function.

    As torchtitan's Trainer does before it builds the model: the model config gets its sharding config
    (``update_from_config`` calls ``set_llama3_sharding_config``; called directly here, because
    ``update_from_config`` imports ``torchtitan.trainer``, which needs tensorboard) and the SPMD backend is set
    process-wide (``set_spmd_backend``). Without the sharding config ``parallelize`` shards nothing: every TP
    rank holds full-size tensors on a 1-rank FSDP mesh and trains its own copy (the embedding still splits the
    vocabulary by TP rank)."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    titan_dims.device_type = "cpu"
    spec = model_registry("debugmodel")
    config = spec.model
    config.layers = config.layers[:2]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig(data_parallel_shard_degree=fsdp, tensor_parallel_degree=tp, spmd_backend=backend)
    if sharding:
        set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    titan_utils.set_spmd_backend(backend)
    with torch.device("meta"):
        model = config.build()
    world = dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=fsdp, cp=1, tp=tp, pp=1, ep=1, world_size=world, spmd_backend=backend)
    dims.build_mesh()
    model = spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=TrainingConfig(),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizer_config = default_adamw(lr=1e-3, foreach=False)
    optimizer_config.implementation = "for-loop"
    optimizers = optimizer_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    return model, optimizers, schedulers


def _train(model: Any, optimizers: Any, schedulers: Any, steps: int) -> None:
    generator = torch.Generator().manual_seed(7)
    positions = torch.arange(16).expand(2, 16)
    for _ in range(steps):
        tokens = torch.randint(0, 2048, (2, 16), generator=generator)
        model(tokens, positions=positions).float().pow(2).mean().backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()


def _digests(model: Any, optimizers: Any) -> dict[str, str]:
    """SHA-256 of every full (gathered) tensor of the model and optimizer state, and the plain values.
    Collective (``full_tensor``): every rank calls it."""
    out: dict[str, str] = {}
    for prefix, state in (("model", model.state_dict()), ("optimizer", optimizers.state_dict())):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                raw = full.detach().contiguous().view(torch.uint8) if full.dim() else full.reshape(1).view(torch.uint8)
                out[f"{prefix}.{key}"] = f"{full.dtype}:{tuple(full.shape)}:" + hashlib.sha256(raw.numpy()).hexdigest()
            else:
                out[f"{prefix}.{key}"] = repr(value)
    return out


def _managers(folder: str, model: Any, optimizers: Any, schedulers: Any, **extra: Any) -> tuple[Any, Any, Any]:
    from torchtitan.components.checkpointer import CheckpointManager

    ours, train = _ours(folder, model, optimizers, schedulers, None, **extra)
    theirs = CheckpointManager.Config(enable=True, folder="dcp", interval=1, keep_latest_k=0).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train},
        sd_adapter=None,
        base_folder=folder,
    )
    return ours, theirs, train


def rank_train_and_save(ctx: RankContext, folder: str, fsdp: int, tp: int) -> dict[str, str]:
    """Train 3 steps at (fsdp, tp), saving every step through reshard (keep_latest_k=2) and the last one through
    torchtitan's DCP manager too; the digests of the state at step 3."""
    model, optimizers, schedulers = _build(fsdp, tp, seed=0)
    ours, theirs, train = _managers(folder, model, optimizers, schedulers, keep_latest_k=2)
    for step in (1, 2, 3):
        _train(model, optimizers, schedulers, 1)
        train.step, train.ntokens_seen = step, 64 * step
        assert ours.save(step)
    assert theirs.save(3)
    steps = ours.steps()
    ours.close()
    theirs.close()
    digests = _digests(model, optimizers)
    digests["steps"] = repr(steps)
    digests["lr"] = repr(schedulers.state_dict())
    return digests


def rank_resume(ctx: RankContext, folder: str, fsdp: int, tp: int, backend: str) -> dict[str, str]:
    """A fresh model at (fsdp, tp), initialised with another seed and trained one step (so that every tensor
    differs from the checkpoint), resumed at the latest step through ``backend``; the digests after it."""
    model, optimizers, schedulers = _build(fsdp, tp, seed=1)
    _train(model, optimizers, schedulers, 1)
    ours, theirs, train = _managers(folder, model, optimizers, schedulers)
    manager = ours if backend == "reshard" else theirs
    assert manager.load()
    ours.close()
    theirs.close()
    digests = _digests(model, optimizers)
    digests["train"] = f"{train.step},{train.ntokens_seen}"
    digests["lr"] = repr(schedulers.state_dict())
    return digests


@pytest.fixture(scope="module")
def saved(pools: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    folder = str(tmp_path_factory.mktemp("titan"))
    pool: RankPool = pools.get(2)
    digests = pool.run_ok(rank_train_and_save, folder, 2, 1, timeout_s=280)
    assert digests[0] == digests[1]
    return folder, digests[0]


def test_keep_latest_k_keeps_the_newest_steps(saved: tuple[str, dict[str, str]]) -> None:
    folder, digests = saved
    assert digests["steps"] == "[2, 3]"
    assert sorted(p.name for p in (Path(folder) / "reshard").iterdir() if p.name.startswith("step_")) == [
        "step_000000002",
        "step_000000003",
    ]


def test_fsdp2_checkpoint_resumes_at_tp2_bit_exact_and_equal_to_torchtitans_dcp_resume(
    pools: Any, saved: tuple[str, dict[str, str]]
) -> None:
    """Saved under FSDP 2, resumed under TP 2: every model and optimizer tensor (gathered) equals the saved one
    bit for bit, the LR scheduler and train state are back, and torchtitan's own DCP manager's resume of the
    same step at the same layout gives the same bytes."""
    folder, want = saved
    pool: RankPool = pools.get(2)
    ours = pool.run_ok(rank_resume, folder, 1, 2, "reshard", timeout_s=280)
    theirs = pool.run_ok(rank_resume, folder, 1, 2, "dcp", timeout_s=280)
    assert ours[0] == ours[1]
    tensors = {k: v for k, v in want.items() if k.startswith(("model.", "optimizer."))}
    assert len(tensors) > 40  # 2 layers' parameters, their AdamW moments and steps, the param groups' values
    assert {k: ours[0][k] for k in tensors} == tensors
    assert ours[0]["lr"] == want["lr"] and ours[0]["train"] == "3,192"
    assert {k: theirs[0][k] for k in tensors} == {k: ours[0][k] for k in tensors}


def _local_shapes(model: Any) -> dict[str, str]:
    """Each model state entry's global shape, placements and this rank's local shape (not collective)."""
    out: dict[str, str] = {}
    for key, value in model.state_dict().items():
        local = value.to_local() if hasattr(value, "to_local") else value
        out[key] = f"{tuple(value.shape)}:{tuple(getattr(value, 'placements', ()))}:{tuple(local.shape)}"
    return out


def rank_tp_train_and_save(ctx: RankContext, folder: str, fsdp: int, tp: int) -> dict[str, Any]:
    """Train 3 steps at (fsdp, tp) and save step 3 through reshard and torchtitan's DCP manager; the digests
    of the gathered state (DTensor's own ``full_tensor``, not reshard) and the local shapes of the layout."""
    model, optimizers, schedulers = _build(fsdp, tp, seed=0)
    ours, theirs, train = _managers(folder, model, optimizers, schedulers)
    _train(model, optimizers, schedulers, 3)
    train.step, train.ntokens_seen = 3, 192
    assert ours.save(3)
    assert theirs.save(3)
    ours.close()
    theirs.close()
    digests = _digests(model, optimizers)
    digests["lr"] = repr(schedulers.state_dict())
    return {"digests": digests, "shapes": _local_shapes(model)}


def rank_resume_shapes(ctx: RankContext, folder: str, fsdp: int, tp: int, backend: str) -> dict[str, Any]:
    """``rank_resume`` and the local shapes of the layout it resumed into."""
    digests = rank_resume(ctx, folder, fsdp, tp, backend)
    model, _, _ = _build(fsdp, tp, seed=1)
    return {"digests": digests, "shapes": _local_shapes(model)}


@pytest.fixture(scope="module")
def saved_tp(pools: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    folder = str(tmp_path_factory.mktemp("titan_tp"))
    return folder, pools.get(2).run_ok(rank_tp_train_and_save, folder, 1, 2, timeout_s=280)


def test_a_tp2_model_is_really_tensor_parallel(saved_tp: tuple[str, list[dict[str, Any]]]) -> None:
    """torchtitan's TP 2 layout under ``partial_dtensor``: column-parallel weights split on dim 0, row-parallel
    ones on dim 1, the vocabulary split over the TP ranks, norms replicated; both ranks' gathered state equal."""
    _, results = saved_tp
    shapes = results[0]["shapes"]
    assert shapes["layers.0.attention.wo.weight"].endswith(":(256, 128)")
    assert shapes["layers.0.feed_forward.w1.weight"].endswith(":(384, 256)")
    assert shapes["layers.0.feed_forward.w2.weight"].endswith(":(256, 384)")
    assert shapes["tok_embeddings.weight"].endswith(":(1024, 256)")
    assert shapes["lm_head.weight"].endswith(":(1024, 256)")
    assert shapes["norm.weight"].endswith(":(256,)")
    assert results[0]["digests"] == results[1]["digests"]


def test_a_tp2_checkpoint_resumes_at_fsdp2_bit_exact_and_equal_to_torchtitans_dcp_resume(
    pools: Any, saved_tp: tuple[str, list[dict[str, Any]]]
) -> None:
    """Saved under TP 2 (each rank's TP shard as its box of the global tensor), resumed under FSDP 2: every
    model and optimizer tensor, gathered, equals the TP run's gathered tensor bit for bit, and torchtitan's own
    DCP manager's resume of its TP 2 save at FSDP 2 gives the same bytes."""
    folder, results = saved_tp
    want = results[0]["digests"]
    pool: RankPool = pools.get(2)
    ours = pool.run_ok(rank_resume_shapes, folder, 2, 1, "reshard", timeout_s=280)
    theirs = pool.run_ok(rank_resume_shapes, folder, 2, 1, "dcp", timeout_s=280)
    assert ours[0]["shapes"]["layers.0.attention.wo.weight"].endswith(":(128, 256)")  # FSDP 2: dim 0 halves
    tensors = {k: v for k, v in want.items() if k.startswith(("model.", "optimizer."))}
    assert len(tensors) > 40
    for got in ours:
        assert {k: got["digests"][k] for k in tensors} == tensors
        assert got["digests"]["lr"] == want["lr"] and got["digests"]["train"] == "3,192"
    assert {k: theirs[0]["digests"][k] for k in tensors} == tensors


def test_an_fsdp2_x_tp2_checkpoint_on_4_ranks_resumes_at_fsdp2_bit_exact_and_equal_to_torchtitans_dcp_resume(
    pools: Any, tmp_path: Path
) -> None:
    """Saved under FSDP 2 x TP 2 on 4 ranks (FSDP2's ``_StridedShard`` over TP's ``Shard``: each rank's box a
    quarter of ``wo``, a strided quarter of ``w1``), resumed under FSDP 2 on 2 ranks: every gathered model and
    optimizer tensor equals the 4-rank run's bit for bit, as torchtitan's own DCP resume of its save does."""
    saved = pools.get(4).run_ok(rank_tp_train_and_save, str(tmp_path), 2, 2, timeout_s=400)
    shapes, want = saved[0]["shapes"], saved[0]["digests"]
    assert shapes["layers.0.attention.wo.weight"].endswith(":(128, 128)")
    assert shapes["layers.0.feed_forward.w1.weight"].endswith(":(192, 256)")
    assert all(got["digests"] == want for got in saved)
    pool: RankPool = pools.get(2)
    ours = pool.run_ok(rank_resume, str(tmp_path), 2, 1, "reshard", timeout_s=280)
    theirs = pool.run_ok(rank_resume, str(tmp_path), 2, 1, "dcp", timeout_s=280)
    tensors = {k: v for k, v in want.items() if k.startswith(("model.", "optimizer."))}
    assert len(tensors) > 40
    assert {k: ours[0][k] for k in tensors} == tensors and ours[0] == ours[1]
    assert {k: theirs[0][k] for k in tensors} == tensors


def rank_full_dtensor_tp(ctx: RankContext, folder: str) -> dict[str, Any]:
    """A TP 2 model under ``spmd_backend="full_dtensor"`` (DTensors on the full ``dp_shard`` x ``tp`` mesh; not
    trained: its forward takes DTensor inputs, which the trainer makes) saved through reshard as step 1, then
    loaded into a fresh FSDP 2 model (``partial_dtensor``, another seed); the gathered model digests of both."""
    model, optimizers, _ = _build(1, 2, seed=0, backend="full_dtensor")
    shapes = _local_shapes(model)
    manager, _ = _ours(folder, model, None, None, None)
    assert manager.save(1)
    manager.close()
    want = {k: v for k, v in _digests(model, optimizers).items() if k.startswith("model.")}
    fresh, fresh_optimizers, _ = _build(2, 1, seed=1)
    reader, _ = _ours(folder, fresh, None, None, None)
    assert reader.load()
    reader.close()
    got = {k: v for k, v in _digests(fresh, fresh_optimizers).items() if k.startswith("model.")}
    return {"shapes": shapes, "want": want, "got": got}


def test_a_full_dtensor_tp2_checkpoint_resumes_at_fsdp2_bit_exact(pools: Any, tmp_path: Path) -> None:
    results = pools.get(2).run_ok(rank_full_dtensor_tp, str(tmp_path), timeout_s=280)
    assert results[0]["shapes"]["layers.0.attention.wo.weight"].endswith(":(256, 128)")
    assert len(results[0]["want"]) > 15
    assert all(got["got"] == got["want"] == results[0]["want"] for got in results)


def rank_unsharded_tp(ctx: RankContext, folder: str) -> dict[str, Any]:
    """A TP 2 mesh over a model without torchtitan's sharding config: every TP rank holds full-size tensors
    (DTensors on the 1-rank FSDP mesh) and, trained one step, different ones. The reshard save's error."""
    from reshard.errors import ShardingError

    model, optimizers, schedulers = _build(1, 2, seed=0, sharding=False)
    _train(model, optimizers, schedulers, 1)
    shapes = _local_shapes(model)
    manager, _ = _ours(folder, model, optimizers, schedulers, None)
    error = ""
    try:
        manager.save(1)
    except ShardingError as exc:
        error = str(exc)
    finally:
        manager.close()
    return {"error": error, "shapes": shapes}


def test_full_size_copies_on_the_tp_ranks_fail_the_save_on_every_rank_and_write_nothing(
    pools: Any, tmp_path: Path
) -> None:
    """What the earlier tests built for TP 2 (no sharding config): not a TP layout. The save refuses it
    (``ShardingError`` on every rank: two ranks claim the same box) and no step is committed."""
    results = pools.get(2).run_ok(rank_unsharded_tp, str(tmp_path), timeout_s=280)
    assert results[0]["shapes"]["layers.0.attention.wo.weight"].endswith(":(256, 256)")
    assert all("claimed as primary by ranks 0 and 1" in got["error"] for got in results)
    assert not [p for p in (tmp_path / "reshard").iterdir() if p.name.startswith("step_")]


def rank_spmd_types_tp(ctx: RankContext, folder: str) -> dict[str, Any]:
    """torchtitan's debug Llama parallelized at TP 2 under ``spmd_backend="spmd_types"`` by its own
    ``Module.parallelize`` (torchtitan's ``parallelize_llama`` then fails in FSDP2's ``fully_shard`` on torch
    2.13: "all parameters must be DTensors on the full SPMD mesh"): its parameters are plain tensors holding
    each rank's TP shard, which a state dict cannot place in the global tensor. Building the reshard manager
    over it must fail; what it raised, and the local shapes."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    titan_dims.device_type = "cpu"
    config = model_registry("debugmodel").model
    config.layers = config.layers[:1]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=True)
    titan_utils.set_spmd_backend("spmd_types")
    try:
        with torch.device("meta"):
            model = config.build()
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2, spmd_backend="spmd_types")
        dims.build_mesh()
        model.parallelize(dims)
        model.to_empty(device="cpu")
        shapes = _local_shapes(model)
        try:
            manager, _ = _ours(folder, model, None, None, None)
        except CheckpointError as error:
            return {"error": str(error), "shapes": shapes}
        manager.close()
        return {"error": "", "shapes": shapes}
    finally:
        titan_utils.set_spmd_backend("partial_dtensor")


def test_a_spmd_types_tp_model_of_plain_local_shards_is_refused_on_every_rank(pools: Any, tmp_path: Path) -> None:
    """Under ``spmd_types`` a TP parameter is a plain tensor of the rank's shard (``wo``: 256 x 128 of 256 x
    256): saved, rank 0's shard would pass for the whole tensor. The manager refuses it when it is built, with
    CheckpointError on every rank."""
    results = pools.get(2).run_ok(rank_spmd_types_tp, str(tmp_path), timeout_s=280)
    assert results[0]["shapes"]["layers.0.attention.wo.weight"] == "(256, 128):():(256, 128)"
    for got in results:
        assert "spmd_backend='spmd_types'" in got["error"]
        assert "parameter 'tok_embeddings.weight' is a plain tensor" in got["error"]
    assert not (tmp_path / "reshard").exists()


def rank_refuses_async(ctx: RankContext, folder: str) -> str:
    model, optimizers, schedulers = _build(2, 1, seed=0)
    try:
        _managers(folder, model, optimizers, schedulers, async_mode="threads")
    except CheckpointError as error:
        return str(error)
    return "built"


def test_an_async_mode_it_cannot_honour_is_refused_on_every_rank(pools: Any, tmp_path: Path) -> None:
    results = pools.get(2).run_ok(rank_refuses_async, str(tmp_path), timeout_s=280)
    assert all("async_mode='threads': not one of disabled, async, async_with_pinned_mem" in r for r in results)


def rank_disagrees_on_async(ctx: RankContext, folder: str) -> str:
    model, optimizers, schedulers = _build(2, 1, seed=0)
    try:
        _managers(folder, model, optimizers, schedulers, async_mode="async" if ctx.rank == 0 else "disabled")
    except CheckpointError as error:
        return str(error)
    return "built"


def test_an_async_mode_on_some_ranks_only_is_the_same_error_on_every_rank(pools: Any, tmp_path: Path) -> None:
    """The contract suite's disagreement rule: an async mode on rank 0 alone made a process group on rank 0 alone
    (rank 1 went on), a hang until the default group's timeout."""
    results = pools.get(2).run_ok(rank_disagrees_on_async, str(tmp_path), timeout_s=280)
    assert all("checkpoint options differ between ranks: async_mode" in r for r in results), results


def rank_async_saves(ctx: RankContext, folder: str) -> dict[str, Any]:
    """For each async mode: train and save steps 1-3 asynchronously (keep_latest_k=2), changing every tensor
    (another training step) right after each save returns; then resume a fresh model from the newest step."""
    out: dict[str, Any] = {}
    for mode in ("async", "async_with_pinned_mem"):
        model, optimizers, schedulers = _build(2, 1, seed=0)
        ours, theirs, train = _managers(
            f"{folder}/{mode}", model, optimizers, schedulers, async_mode=mode, keep_latest_k=2
        )
        theirs.close()
        in_flight = []
        for step in (1, 2, 3):
            _train(model, optimizers, schedulers, 1)
            train.step, train.ntokens_seen = step, 64 * step
            assert ours.save(step)
            in_flight.append(ours.save_future is not None)
            saved = _digests(model, optimizers)
            ours.maybe_wait_for_staging()
            _train(model, optimizers, schedulers, 1)  # changes every tensor while the save may still run
        assert _digests(model, optimizers) != saved
        ours.close()  # waits for step 3
        fresh, fresh_optimizers, fresh_schedulers = _build(1, 2, seed=1)
        reader, theirs, fresh_train = _managers(f"{folder}/{mode}", fresh, fresh_optimizers, fresh_schedulers)
        theirs.close()
        assert reader.load()
        reader.close()
        out[mode] = {
            "in_flight": in_flight,
            "steps": sorted(p.name for p in (Path(folder) / mode / "reshard").iterdir()),
            "equal": _digests(fresh, fresh_optimizers) == saved,
            "train": [fresh_train.step, fresh_train.ntokens_seen],
        }
    return out


def test_async_modes_save_the_snapshot_taken_when_save_returned_and_resume_at_another_layout(
    pools: Any, tmp_path: Path
) -> None:
    """``async_mode`` "async" and "async_with_pinned_mem": each save returns with the save in flight
    (``save_future`` set), the tensors change at once, and the committed step holds the state of the moment
    ``save`` returned (resumed under TP 2, bit-exact); ``close`` waits for the last save; keep_latest_k holds."""
    results = pools.get(2).run_ok(rank_async_saves, str(tmp_path), timeout_s=400)
    for mode in ("async", "async_with_pinned_mem"):
        got = results[0][mode]
        assert got["in_flight"] == [True, True, True]
        assert got["equal"] is True and results[1][mode]["equal"] is True
        assert got["train"] == [3, 192]
        assert [n for n in got["steps"] if n.startswith("step_")] == ["step_000000002", "step_000000003"]


def _adapter() -> Any:
    """torchtitan's own Llama 3 state-dict adapter for the model ``_build`` makes (no HF assets)."""
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    config = spec.model
    config.layers = config.layers[:2]
    return spec.state_dict_adapter(config, None)


def _hf_managers(folder: str, model: Any, optimizers: Any, schedulers: Any, **extra: Any) -> tuple[Any, Any]:
    """The reshard and the DCP manager of one trainer, with the adapter, under ``folder/reshard`` and
    ``folder/dcp``."""
    from torchtitan.components.checkpointer import CheckpointManager

    from reshard.interop.torchtitan import ReshardCheckpointManager

    built = []
    for config in (
        ReshardCheckpointManager.Config(enable=True, folder="reshard", **extra),
        CheckpointManager.Config(enable=True, folder="dcp", keep_latest_k=0, **extra),
    ):
        built.append(
            config.build(
                dataloader=None,
                model_parts=[model],
                optimizers=optimizers,
                lr_schedulers=schedulers,
                states={},
                sd_adapter=_adapter(),
                base_folder=folder,
            )
        )
    return built[0], built[1]


def _safetensors_digests(directory: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    out: dict[str, str] = {}
    for path in sorted(directory.glob("*.safetensors")):
        for key, value in load_file(str(path)).items():
            raw = value.contiguous().reshape(-1).view(torch.uint8)
            out[key] = f"{value.dtype}:{tuple(value.shape)}:" + hashlib.sha256(raw.numpy()).hexdigest()
    return out


def rank_hf_in_and_out(ctx: RankContext, folder: str) -> dict[str, Any]:
    """HF safetensors written by safetensors from the adapter's ``to_hf`` of an FSDP 2 model (seed 2) are
    loaded into fresh TP 2 models by both managers (``initial_load_path`` + ``initial_load_in_hf``); then both
    managers save the FSDP 2 model's last step in HF (bfloat16)."""
    from safetensors.torch import save_file

    source, source_optimizers, _ = _build(2, 1, seed=2)
    want = {k: v for k, v in _digests(source, source_optimizers).items() if k.startswith("model.")}
    full = {k: v.full_tensor() for k, v in source.state_dict().items()}
    hf_in = Path(folder) / "hf_in"
    if ctx.rank == 0:
        hf_in.mkdir()
        save_file({k: v.contiguous() for k, v in _adapter().to_hf(full).items()}, str(hf_in / "model.safetensors"))
    dist.barrier()
    got = {}
    for backend in ("reshard", "dcp"):
        model, optimizers, schedulers = _build(1, 2, seed=1)
        ours, theirs = _hf_managers(
            f"{folder}/{backend}", model, optimizers, schedulers, initial_load_path=str(hf_in), initial_load_in_hf=True
        )
        assert (ours if backend == "reshard" else theirs).load()
        got[backend] = {k: v for k, v in _digests(model, optimizers).items() if k.startswith("model.")}
        for manager in (ours, theirs):
            manager.close()
    out_folder = f"{folder}/out"
    ours, theirs = _hf_managers(
        out_folder, source, source_optimizers, None, last_save_in_hf=True, export_dtype="bfloat16"
    )
    assert ours.save(5, last_step=True) and theirs.save(5, last_step=True)
    ours.close()
    theirs.close()
    exported = {}
    if ctx.rank == 0:
        exported = {name: _safetensors_digests(Path(out_folder) / name / "step-5") for name in ("reshard", "dcp")}
    return {"want": want, "got": got, "exported": exported}


def test_hf_safetensors_load_and_last_save_through_the_adapter_equal_torchtitans_dcp_path(
    pools: Any, tmp_path: Path
) -> None:
    """``initial_load_in_hf``: the model loaded from HF safetensors under TP 2 equals, bit for bit, the FSDP 2
    model the file was written from and torchtitan's own DCP + HuggingFaceStorageReader load of it;
    ``last_save_in_hf``: the exported safetensors hold the same names, dtypes, shapes and bytes as torchtitan's
    own HF save."""
    results = pools.get(2).run_ok(rank_hf_in_and_out, str(tmp_path), timeout_s=400)
    got = results[0]
    assert len(got["want"]) > 15
    assert got["got"]["reshard"] == got["want"]
    assert got["got"]["dcp"] == got["want"]
    ours, theirs = got["exported"]["reshard"], got["exported"]["dcp"]
    assert len(ours) > 15 and all(v.startswith("torch.bfloat16:") for v in ours.values())
    assert ours == theirs


def _loader(rank: int) -> Any:
    from torchtitan.components.dataloader import ParallelAwareDataloader

    return ParallelAwareDataloader(TinyTokens(rank), dp_rank=rank, dp_world_size=2, batch_size=2)


def _ours(folder: str, model: Any, optimizers: Any, schedulers: Any, loader: Any, **extra: Any) -> tuple[Any, Any]:
    from reshard.interop.torchtitan import ReshardCheckpointManager

    train = TrainState()
    manager = ReshardCheckpointManager.Config(enable=True, folder="reshard", interval=1, **extra).build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train},
        sd_adapter=None,
        base_folder=folder,
    )
    return manager, train


def _resume(ctx: RankContext, folder: str, step: int = -1, **extra: Any) -> dict[str, Any]:
    """A fresh model (TP 2 layout, another seed, one step trained), dataloader and train state, loaded by a
    reshard manager of ``folder``; what came back."""
    model, optimizers, schedulers = _build(1, 2, seed=1)
    _train(model, optimizers, schedulers, 1)
    loader = _loader(ctx.rank)
    manager, train = _ours(folder, model, optimizers, schedulers, loader, **extra)
    try:
        # torchtitan's trainer calls load(step=config.checkpoint.load_step); so do these resumes given load_step
        assert manager.load(manager.config.load_step if "load_step" in extra else step)
    finally:
        manager.close()
    return {
        "digests": _digests(model, optimizers),
        "train": [train.step, train.ntokens_seen],
        "next": next(iter(loader)).tolist(),
    }


def rank_train_state_dataloader_and_load_policies(ctx: RankContext, folder: str) -> dict[str, Any]:
    """Train and save steps 1-3 at FSDP 2 with torchtitan's ParallelAwareDataloader (one batch per step) and
    the train state; then resume fresh trainers under each load policy."""
    model, optimizers, schedulers = _build(2, 1, seed=0)
    loader = _loader(ctx.rank)
    manager, train = _ours(f"{folder}/run", model, optimizers, schedulers, loader)
    batches, digests = {}, {}
    it = iter(loader)
    for step in (1, 2, 3):
        batches[step] = next(it).tolist()
        _train(model, optimizers, schedulers, 1)
        train.step, train.ntokens_seen = step, 64 * step
        assert manager.save(step)
        digests[step] = _digests(model, optimizers)
    batches[4] = next(it).tolist()
    manager.close()
    missing = ""
    try:
        _resume(ctx, f"{folder}/run", step=7)
    except CheckpointNotFoundError as error:
        missing = str(error)
    initial = f"{folder}/run/reshard/step_000000002"
    return {
        "batches": batches,
        "digests": digests,
        "step2": _resume(ctx, f"{folder}/run", step=2),
        "latest": _resume(ctx, f"{folder}/run"),
        "load_step2": _resume(ctx, f"{folder}/run", load_step=2),
        "missing": missing,
        "excluded": _resume(ctx, f"{folder}/run", exclude_from_loading=["dataloader", "train_state"]),
        "initial_model": _resume(ctx, f"{folder}/init_model", initial_load_path=initial),
        "initial_full": _resume(ctx, f"{folder}/init_full", initial_load_path=initial, initial_load_model_only=False),
    }


def _split(digests: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    model = {k: v for k, v in digests.items() if k.startswith("model.")}
    return model, {k: v for k, v in digests.items() if k.startswith("optimizer.")}


def test_train_state_dataloader_load_step_exclusions_and_initial_loads_restore_what_torchtitan_restores(
    pools: Any, tmp_path: Path
) -> None:
    """Saved at FSDP 2 with torchtitan's ParallelAwareDataloader, resumed at another layout: the latest step
    brings back the model and optimizer (bit-exact), the train state (step, ntokens_seen) and each data-parallel
    rank's dataloader position (its next batch is the one after the saved step); ``load(step)`` and
    ``load_step`` pick an older step, a step that is not there is CheckpointNotFoundError on every rank;
    ``exclude_from_loading`` leaves the dataloader and train state as they were; ``initial_load_path`` into an
    empty folder loads the model only (``initial_load_model_only``) or everything."""
    results = pools.get(2).run_ok(rank_train_state_dataloader_and_load_policies, str(tmp_path), timeout_s=500)
    for rank, got in enumerate(results):
        batches = {int(k): v for k, v in got["batches"].items()}
        assert batches[1] == [[1000 * rank + 1], [1000 * rank + 2]]
        saved = {int(k): v for k, v in got["digests"].items()}
        assert saved[2] != saved[3]
        assert got["latest"]["digests"] == saved[3]
        assert got["latest"]["train"] == [3, 192] and got["latest"]["next"] == batches[4]
        for older in ("step2", "load_step2"):
            assert got[older]["digests"] == saved[2]
            assert got[older]["train"] == [2, 128] and got[older]["next"] == batches[3]
        assert "checkpoint.load_step=7" in got["missing"]
        assert got["excluded"]["digests"] == saved[3]
        assert got["excluded"]["train"] == [0, 0] and got["excluded"]["next"] == batches[1]
        model_only = got["initial_model"]
        assert _split(model_only["digests"])[0] == _split(saved[2])[0]
        assert _split(model_only["digests"])[1] != _split(saved[2])[1]
        assert model_only["train"] == [0, 0] and model_only["next"] == batches[1]
        assert got["initial_full"]["digests"] == saved[2]
        assert got["initial_full"]["train"] == [2, 128] and got["initial_full"]["next"] == batches[3]


def rank_async_save_fails(ctx: RankContext, folder: str) -> dict[str, Any]:
    """Step 1 saved asynchronously; then another holder (rank 0, through reshard's own lock) holds the folder's
    manager lock while step 2 is saved in the background; ``close`` waits for it and raises its error."""
    from reshard.io.locking import acquire_lock
    from reshard.storage import storage_for

    model, optimizers, schedulers = _build(2, 1, seed=0)
    ours, theirs, _ = _managers(folder, model, optimizers, schedulers, async_mode="async")
    theirs.close()
    _train(model, optimizers, schedulers, 1)
    assert ours.save(1)
    ours.maybe_wait_for_saving()
    root = storage_for(f"{folder}/reshard")
    held = acquire_lock(root, "another-writer", what="manager") if ctx.rank == 0 else None
    _train(model, optimizers, schedulers, 1)
    assert ours.save(2)
    error = ""
    try:
        ours.close()
    except CheckpointError as exc:
        error = type(exc).__name__
    finally:
        if held is not None:
            held.release()
        root.close()
    steps = sorted(p.name for p in (Path(folder) / "reshard").iterdir() if p.name.startswith("step_"))
    return {"error": error, "steps": steps}


def test_a_failed_background_save_is_raised_by_close_on_every_rank_and_keeps_the_previous_step(
    pools: Any, tmp_path: Path
) -> None:
    results = pools.get(2).run_ok(rank_async_save_fails, str(tmp_path), timeout_s=400)
    assert [r["error"] for r in results] == ["CheckpointLockedError", "CheckpointLockedError"]
    assert results[0]["steps"] == ["step_000000001"]
