"""HF -> Megatron -> HF is bit-identical at TP x PP 1 x 1 and 2 x 2; Megatron logits match transformers at
TP=1 and TP=2. The cases that load checkpoints into Megatron share one spawned world per rank count
(``one_rank``, ``two_ranks``; ``rank_cases``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hf_models import ARCHS, make_tiny_hf
from rank_cases import case, run_cases

from megagrpo.ckpt.convert import hf_to_megatron, megatron_to_hf
from megagrpo.ckpt.hf_files import HFCheckpoint
from megagrpo.ckpt.megatron import load_megatron, mapped_checkpoint_tensors, read_model
from megagrpo.models.builder import build_stage
from megagrpo.parallel import ParallelSizes, destroy_parallel, init_parallel

pytestmark = pytest.mark.dist

# TP 2 x PP 2 splits every tensor both ways at once (and loads back at TP 1 and 2 in the logits test); TP 2
# alone and PP 2 alone add nothing it does not cover, and cost a conversion each per architecture.
LAYOUTS = [(1, 1), (2, 2)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_tiny_hf(arch, root / arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory):
    """Megatron checkpoints by (arch, tp, pp), converted once per module."""
    root, cache = tmp_path_factory.mktemp("megatron"), {}

    def get(arch: str, tp: int, pp: int) -> Path:
        key = (arch, tp, pp)
        if key not in cache:
            cache[key] = hf_to_megatron(hf_dirs[arch], root / f"{arch}-tp{tp}-pp{pp}", tp=tp, pp=pp)
        return cache[key]

    return get


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_identical(arch, tp, pp, hf_dirs, converted, tmp_path):
    ckpt = converted(arch, tp, pp)
    out = megatron_to_hf(ckpt, tmp_path / "hf", max_shard_bytes=150_000)
    src, back = HFCheckpoint(hf_dirs[arch]), HFCheckpoint(out)
    assert set(back.tensors) == set(src.tensors)
    for name in src.tensors:
        a, b = src.read(name), back.read(name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    # Several shards plus an index, and the config files travelled with the weights.
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 2
    assert (out / "config.json").read_text() == (hf_dirs[arch] / "config.json").read_text()
    assert (out / "generation_config.json").is_file()


def _mapped_and_loaded(ckpt: str) -> tuple[list[str], dict[str, bool], int]:
    """What an export maps from the checkpoint files, compared with what Megatron loads."""
    source = read_model(Path(ckpt))
    ctx = init_parallel(ParallelSizes(), backend="gloo")
    model = build_stage(ctx, source.shape, source.dtype)
    _, mapped, rest = mapped_checkpoint_tensors(model, Path(ckpt) / "megatron")
    load_megatron(model, Path(ckpt) / "megatron")
    params = {name: p.detach() for name, p in model.named_parameters()}
    same = {}
    for name, tensor in mapped.items():
        got = torch.cat(tensor) if isinstance(tensor, tuple) else tensor
        same[name] = got.dtype == params[name].dtype and torch.equal(got, params[name])
    return sorted(rest), same, len(params)


@pytest.fixture(scope="module")
def bf16_ckpts(tmp_path_factory) -> dict[int, tuple[Path, Path]]:
    """(source HF directory, its Megatron checkpoint) of a bf16 model, saved at TP 1 and at TP 2."""
    root = tmp_path_factory.mktemp("bf16")
    src_dir = make_tiny_hf("qwen2", root / "src", dtype=torch.bfloat16)
    return {tp: (src_dir, hf_to_megatron(src_dir, root / f"ckpt-tp{tp}", tp=tp)) for tp in (1, 2)}


@pytest.fixture(scope="module")
def one_rank(hf_dirs, converted, bf16_ckpts, tmp_path_factory) -> list[dict]:
    """The single-rank cases of this module on one spawned rank (``rank_cases``)."""
    cases = {
        f"mapped/{arch}-{tp}-{pp}": (_mapped_and_loaded, str(converted(arch, tp, pp)))
        for arch in ARCHS
        for tp, pp in LAYOUTS
    }
    cases["one_chunk_refused"] = (_one_chunk_refused, str(converted("qwen2", 1, 1)))
    for tp, (_, ckpt) in bf16_ckpts.items():
        cases[f"bf16/{tp}"] = (_stage_param_dtypes, str(ckpt))
    out = tmp_path_factory.mktemp("unfilled") / "ckpt"
    cases["unfilled"] = (_unfilled_qkv_written_without_the_copier, str(hf_dirs["qwen2"]), str(out))
    cases["groups_left"] = (_groups_left,)  # last: it ends with no process group at all
    return run_cases(1, cases)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_export_maps_the_stored_chunks(arch, tp, pp, converted, one_rank):
    """An export takes each weight straight from the mapped checkpoint files (the chunks stacked
    where the checkpoint was saved at TP=2) and equals what Megatron loads; only row-parallel weights
    saved at TP=2 (split along their columns) are left to Megatron."""
    ckpt = converted(arch, tp, pp)
    ((rest, same, count),) = case(one_rank, f"mapped/{arch}-{tp}-{pp}")
    assert same and all(same.values()), [name for name, ok in same.items() if not ok]
    assert len(same) + len(rest) == count
    row_parallel = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
    assert all(name.endswith(row_parallel) for name in rest)
    assert len(rest) == (0 if tp == 1 else 2 * read_model(ckpt).shape.num_layers)


def _one_chunk_refused(ckpt: str) -> tuple[list[str], bool]:
    """An export where the reader cannot map layer 1's QKV weight: Megatron loads that key whole."""
    from unittest import mock

    from megagrpo.ckpt.dist_files import MappedDistCheckpoint

    real_read = MappedDistCheckpoint.read

    def read(self, key, offsets, sizes, axis=0):
        if key.endswith("linear_qkv.weight") and offsets[0] == 1:
            return None
        return real_read(self, key, offsets, sizes, axis)

    source = read_model(Path(ckpt))
    ctx = init_parallel(ParallelSizes(), backend="gloo")
    model = build_stage(ctx, source.shape, source.dtype)
    with mock.patch.object(MappedDistCheckpoint, "read", read):
        _, mapped, rest = mapped_checkpoint_tensors(model, Path(ckpt) / "megatron")
    load_megatron(model, Path(ckpt) / "megatron", keys=set(rest))
    filled = {name: p.detach().clone() for name, p in model.named_parameters() if name in rest}
    load_megatron(model, Path(ckpt) / "megatron")
    params = dict(model.named_parameters())
    same = all(torch.equal(filled[name], params[name]) for name in rest)
    return sorted(rest), same and not set(rest) & set(mapped)


def test_an_unmapped_chunk_sends_its_whole_key_to_megatron(converted, one_rank):
    ckpt = converted("qwen2", 1, 1)
    ((rest, same),) = case(one_rank, "one_chunk_refused")
    layers = read_model(ckpt).shape.num_layers
    assert rest == sorted(f"decoder.layers.{i}.self_attention.linear_qkv.weight" for i in range(layers))
    assert same


def _stage_param_dtypes(ckpt: str) -> dict:
    source = read_model(Path(ckpt))
    ctx = init_parallel(ParallelSizes(), backend="gloo")
    model = build_stage(ctx, source.shape, source.dtype)
    load_megatron(model, Path(ckpt) / "megatron")
    return {name: p.dtype for name, p in model.named_parameters()}


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_round_trip_keeps_every_dtype(tp, bf16_ckpts, one_rank, tmp_path):
    """A bf16 checkpoint is bf16 throughout: in Megatron (whose local norms are made in fp32) and
    back in HF."""
    src_dir, ckpt = bf16_ckpts[tp]
    (dtypes,) = case(one_rank, f"bf16/{tp}")
    assert any("layernorm" in name for name in dtypes)
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes
    out = megatron_to_hf(ckpt, tmp_path / "hf")
    src, back = HFCheckpoint(src_dir), HFCheckpoint(out)
    assert set(back.tensors) == set(src.tensors)
    for name in src.tensors:
        a, b = src.read(name), back.read(name)
        assert a.dtype == b.dtype == torch.bfloat16, (name, b.dtype)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def megatron_logits(
    ckpt: str, tokens: torch.Tensor, tp: int = 1, *, ep: int = 1, keep_world: bool = False
) -> torch.Tensor:
    """The logits of a megagrpo checkpoint loaded at ``tp`` (and ``ep``, a mixture-of-experts model's
    experts split over the ranks) on this rank's group (the whole vocabulary)."""
    import torch.distributed as dist

    source = read_model(Path(ckpt))
    ctx = init_parallel(ParallelSizes(tp=tp, ep=ep), backend="gloo")
    try:
        model = build_stage(ctx, source.shape, source.dtype)
        load_megatron(model, Path(ckpt) / "megatron")
        model.eval()
        seq = tokens.shape[1]
        mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
        with torch.no_grad():
            logits = model(tokens, torch.arange(seq).expand_as(tokens), mask)  # [b, s, vocab / tp]
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ctx.pgs.tp)
        return torch.cat(parts, dim=-1)[..., : source.shape.vocab_size]
    finally:
        destroy_parallel(keep_world=keep_world)


def _megatron_logits(ckpt: str, tokens: torch.Tensor) -> dict:
    return {tp: megatron_logits(ckpt, tokens, tp, keep_world=True) for tp in (1, 2)}


LOGITS_TOKENS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def two_ranks(converted) -> list[dict]:
    """Each architecture's logits, saved with TP=2 x PP=2 and loaded at TP=1 and TP=2 (one spawn)."""
    return run_cases(
        2, {arch: (_megatron_logits, str(converted(arch, 2, 2)), LOGITS_TOKENS) for arch in ARCHS}
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_megatron_logits_match_transformers(arch, hf_dirs, two_ranks):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hf_dirs[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(LOGITS_TOKENS).logits
    # Saved with TP=2 x PP=2 and loaded at TP=1 and TP=2: the checkpoint reshards on load.
    for res in case(two_ranks, arch):
        for tp in (1, 2):
            diff = (res[tp] - want).abs().max().item()
            assert diff <= 1e-4, f"{arch} TP={tp}: max |logits diff| {diff:.2e}"


def test_killed_conversion_leaves_no_output_directory(hf_dirs, tmp_path):
    out = tmp_path / "ckpt"
    cmd = [
        sys.executable,
        str(REPO / "tools/convert_hf/hf_to_megatron.py"),
        "--hf-dir",
        str(hf_dirs["qwen2"]),
    ]
    proc = subprocess.Popen([*cmd, "--out", str(out), "--tp", "2"], start_new_session=True)
    deadline = time.monotonic() + 300  # generous: the tool imports torch and Megatron first
    # Kill the whole process group as soon as the conversion has started writing.
    while not list(tmp_path.glob(".ckpt.tmp-*")):
        assert proc.poll() is None, f"conversion exited ({proc.returncode}) before it could be killed"
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the conversion wrote no temporary directory in 300 s")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not out.exists()
    # A later run is not blocked by the leftover temporary directory; at TP=PP=1 the tools convert
    # in their own process (no spawned rank), both ways, and the round trip stays exact.
    subprocess.run([*cmd, "--out", str(out)], check=True, timeout=300)
    assert (out / "megagrpo.json").is_file()
    back_dir = tmp_path / "hf"
    export = [sys.executable, str(REPO / "tools/convert_hf/megatron_to_hf.py"), "--ckpt", str(out)]
    subprocess.run([*export, "--out", str(back_dir)], check=True, timeout=300)
    src, back = HFCheckpoint(hf_dirs["qwen2"]), HFCheckpoint(back_dir)
    assert set(back.tensors) == set(src.tensors)
    for name in src.tensors:
        assert torch.equal(src.read(name).view(torch.uint8), back.read(name).view(torch.uint8)), name


def _groups_left() -> tuple[bool, bool, bool]:
    from megagrpo.ckpt.convert import _rank_groups

    left = []
    for exits_after in (False, True):
        with _rank_groups(ParallelSizes(), exits_after):
            pass
        left.append(torch.distributed.is_initialized())
    destroy_parallel()
    with pytest.raises(RuntimeError), _rank_groups(ParallelSizes(), exits_after=True):
        raise RuntimeError("conversion failed")
    return left[0], left[1], torch.distributed.is_initialized()


def test_a_rank_that_exits_next_leaves_its_groups_only_on_success(one_rank):
    ((torn_down, exiting, failed),) = case(one_rank, "groups_left")
    assert (torn_down, exiting, failed) == (False, True, False)


def _unfilled_qkv_written_without_the_copier(hf_dir: str, out: str) -> str:
    from megagrpo.ckpt import convert, megatron
    from megagrpo.models.registry import load_hf_config, shape_from_hf_config

    arch, shape = shape_from_hf_config(load_hf_config(hf_dir), hf_dir)
    hf = HFCheckpoint(hf_dir)
    ctx = init_parallel(ParallelSizes(), backend="gloo")
    model = build_stage(ctx, shape, hf.validate(convert.hf_tensor_shapes(shape)))
    mapped, pieces = {}, {}
    convert.load_hf_into_stage(model, ctx, hf, shape, arch.rules(shape), mapped=mapped, pieces=pieces)
    assert pieces and all("linear_qkv" in key for key in pieces)  # Q/K/V left unfilled
    can_copy = megatron.writers_can_copy
    megatron.writers_can_copy = lambda: False  # as if Megatron opened its files another way
    try:
        with pytest.raises(RuntimeError) as err:
            megatron.save_megatron(model, Path(out), mapped=mapped, pieces=pieces, maps=hf.maps)
    finally:
        megatron.writers_can_copy = can_copy  # the cases after this one write as usual
    return str(err.value)


def test_a_checkpoint_with_unfilled_tensors_the_writer_did_not_copy_is_refused(one_rank):
    (message,) = case(one_rank, "unfilled")
    assert "linear_qkv" in message and "never filled" in message
