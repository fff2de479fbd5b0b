"""Expert parallelism over gloo in 2 and 4 processes: every rank's output equals the
single-process layer's on its tokens, for both dispatch schemes."""

import contextlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit import ExpertsLoRA, FusedMoE, gate
from moekit.distributed import ExpertParallelMoE, shard_layer
from moekit.formats import quantize_experts
from moekit.metrics import Tolerance, check_close

TOKENS_PER_RANK = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _process_group(rank, world, port):
    """This spawned process as rank ``rank`` of a gloo group of ``world``, torn down after."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _worker(rank, world, port, preset, mode):
    with _process_group(rank, world, port):
        torch.manual_seed(0)                                      # the same full layer and batch everywhere
        full = FusedMoE.from_preset(preset, dtype=torch.float32, scaled=True)
        with torch.no_grad():
            if full.w13_bias is not None:                         # nonzero biases: they must not be added twice
                full.w13_bias.normal_(std=0.1)
                full.w2_bias.normal_(std=0.1)
        x = torch.randn(world * TOKENS_PER_RANK, full.spec.hidden_size)
        mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
        ep = ExpertParallelMoE(shard_layer(full, rank, world), mode=mode)
        with torch.no_grad():
            got = ep(x[mine])
            expect = full(x)[mine]
        # The same products summed in another order (ranks, then slots): fp32 rounding only.
        check_close(f"rank {rank} {preset} {mode}", got, expect, Tolerance(1e-5, 1e-6))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["allgather", "all_to_all"])
@pytest.mark.parametrize("preset,why", [
    ("deepseek-v3", "grouped routing, shared expert"),
    ("gpt-oss-120b", "expert biases, swiglu"),
])
def test_expert_parallel_equals_the_single_process_layer(world, mode, preset, why):
    mp.spawn(_worker, args=(world, _free_port(), preset, mode), nprocs=world, join=True)


def test_bad_arguments():
    full = FusedMoE.from_preset("mixtral-8x7b", dtype=torch.float32, scaled=True)
    with pytest.raises(ValueError, match="must be divisible by world_size=3"):
        shard_layer(full, 0, 3)
    with pytest.raises(ValueError, match="mode must be one of"):
        ExpertParallelMoE(shard_layer(full, 0, 2), mode="ring")
    with pytest.raises(ValueError, match="expert_map"):
        ExpertParallelMoE(full)
    E, H, I = full.spec.num_experts, full.spec.hidden_size, full.spec.intermediate_size
    ep = ExpertParallelMoE(shard_layer(full, 0, 2))
    full.load_lora(ExpertsLoRA(torch.randn(1, E, 2, H), torch.randn(1, E, 2 * I, 2), torch.randn(1, E, 2, I),
                               torch.randn(1, E, H, 2), [1.0]))
    with pytest.raises(ValueError, match="without expert LoRA adapters"):  # (each token's adapter would travel)
        shard_layer(full, 0, 2)
    ep.local.load_lora(ExpertsLoRA(torch.randn(1, E // 2, 2, H), torch.randn(1, E // 2, 2 * I, 2),
                                   torch.randn(1, E // 2, 2, I), torch.randn(1, E // 2, H, 2), [1.0]))
    with pytest.raises(ValueError, match="serves no expert LoRA adapters"):
        ep(torch.randn(3, H))


def _quantized_worker(rank, world, port):
    with _process_group(rank, world, port):
        torch.manual_seed(0)
        full = FusedMoE.from_preset("qwen3-30b-a3b", dtype=torch.float32, scaled=True)
        local = shard_layer(full, rank, world)  # quantized after sharding, as shard_layer asks
        local.load_quantized_experts(quantize_experts(local.w13.data, "mxfp4"), quantize_experts(local.w2.data, "mxfp4"))
        full.load_quantized_experts(quantize_experts(full.w13.data, "mxfp4"), quantize_experts(full.w2.data, "mxfp4"))
        x = torch.randn(world * TOKENS_PER_RANK, full.spec.hidden_size)
        mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
        with torch.no_grad():
            got = ExpertParallelMoE(local)(x[mine])
            expect = full(x)[mine]
        check_close(f"rank {rank} MXFP4 shard", got, expect, Tolerance(1e-5, 1e-6))


def test_a_shard_quantized_after_sharding_equals_the_quantized_layer():
    mp.spawn(_quantized_worker, args=(2, _free_port()), nprocs=2, join=True)


def _uneven_worker(rank, world, port):
    gate.set_verification(True)
    with _process_group(rank, world, port):
        full = FusedMoE.from_preset("mixtral-8x7b", dtype=torch.float32, scaled=True)
        ep = ExpertParallelMoE(shard_layer(full, rank, world))
        with pytest.raises(ValueError, match=r"as many tokens on every rank .* got \[5, 3\]"):
            ep(torch.randn(5 - 2 * rank, full.spec.hidden_size))


def test_uneven_batches_in_allgather_mode_are_refused_with_the_gate_on():
    mp.spawn(_uneven_worker, args=(2, _free_port()), nprocs=2, join=True)


def _placement_worker(rank, world, port, mode):
    with _process_group(rank, world, port):
        torch.manual_seed(0)
        full = FusedMoE.from_preset("mixtral-8x7b", dtype=torch.float32, scaled=True)
        E = full.spec.num_experts
        # round-robin placement: all_to_all once sent every pair to rank id // (E / world) whatever the maps said
        mine_ids = list(range(rank, E, world))
        local = shard_layer(full, 0, world)
        with torch.no_grad():
            local.w13 = torch.nn.Parameter(full.w13[mine_ids].clone())
            local.w2 = torch.nn.Parameter(full.w2[mine_ids].clone())
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[mine_ids] = torch.arange(len(mine_ids), dtype=torch.int32)
        local.expert_map = emap
        x = torch.randn(world * TOKENS_PER_RANK, full.spec.hidden_size)
        # rank 0 brings no tokens in all_to_all (an idle rank: its reshape of no rows failed)
        mine = slice(0, 0) if mode == "all_to_all" and rank == 0 else slice(rank * TOKENS_PER_RANK,
                                                                            (rank + 1) * TOKENS_PER_RANK)
        with torch.no_grad():
            got = ExpertParallelMoE(local, mode=mode)(x[mine])
            expect = full(x)[mine]
        check_close(f"rank {rank} round-robin {mode}", got, expect, Tolerance(1e-5, 1e-6))
        # one rank's shard on every rank: half the experts twice, the rest nowhere
        twice = ExpertParallelMoE(shard_layer(full, 0, world), mode=mode)
        with pytest.raises(ValueError, match="expert 0 on 2 ranks"):
            twice(x[:TOKENS_PER_RANK])
        # rank 0 sends two global experts to its local expert 0 (every expert still has one owner): one served twice,
        # silently, before
        dup = shard_layer(full, rank, world)
        if rank == 0:
            dup.expert_map = torch.where(dup.expert_map == 1, 0, dup.expert_map)
        with pytest.raises(ValueError, match="rank 0's expert_map must send each .* local experts \\[0\\]"):
            ExpertParallelMoE(dup, mode=mode)(x[:TOKENS_PER_RANK])


@pytest.mark.parametrize("mode", ["allgather", "all_to_all"])
def test_any_placement_of_the_experts_and_shards_that_do_not_fit(mode):
    mp.spawn(_placement_worker, args=(2, _free_port(), mode), nprocs=2, join=True)


def test_a_shard_is_not_sharded_again_and_x_is_checked():
    full = FusedMoE.from_preset("mixtral-8x7b", dtype=torch.float32, scaled=True)
    with pytest.raises(ValueError, match="takes the full layer, not a shard"):
        shard_layer(shard_layer(full, 1, 2), 0, 2)  # once served experts 0..3 with 4..7's weights
    with pytest.raises(ValueError, match="hidden size H=64"):  # two half rows once made one token
        ExpertParallelMoE(shard_layer(full, 0, 1))(torch.randn(4, 32))


def _grad_mode_worker(rank, world, port):
    with _process_group(rank, world, port):
        full = FusedMoE.from_preset("mixtral-8x7b", dtype=torch.float32, scaled=True)
        x = torch.randn(TOKENS_PER_RANK, full.spec.hidden_size)
        for mode in ("allgather", "all_to_all"):  # allgather once failed outside no_grad (a view written in place)
            with pytest.warns(RuntimeWarning, match="ExpertParallelMoE ran kernels that compute no gradients"):
                got = ExpertParallelMoE(shard_layer(full, rank, world), mode=mode)(x)
            with torch.no_grad():
                check_close(f"{mode} in grad mode", got, full(x), Tolerance(1e-5, 1e-6))
            from moekit import _checks
            _checks._WARNED_DETACHED.discard("ExpertParallelMoE")


def test_expert_parallel_outside_no_grad():
    mp.spawn(_grad_mode_worker, args=(1, _free_port()), nprocs=1, join=True)
