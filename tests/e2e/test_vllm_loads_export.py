"""vLLM serves what ``megatron_to_hf`` writes, and decodes it exactly as transformers decodes the source.

Each architecture's tiny random model goes HF -> Megatron checkpoint (TP=2; the mixture-of-experts
models' experts over EP 2 as well, each expert whole on its rank for Qwen3-MoE, ETP 1, split over TP for
Qwen2-MoE) -> HF export (several shards). transformers must give bit-identical logits on the export and
the source, and vLLM (the CPU build here) must load the export and produce transformers' greedy tokens
on the source, token for token, with matching log-probabilities. The vLLM runs happen in one subprocess
(``_vllm_greedy.py``), one engine at a time, so vLLM's global state never enters pytest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megagrpo.ckpt.convert import hf_to_megatron, megatron_to_hf

pytestmark = pytest.mark.e2e

if importlib.util.find_spec("vllm") is None:  # not imported here: vLLM runs only in the subprocess
    pytest.skip("vLLM is not installed (pip install -e .[cpu])", allow_module_level=True)

VOCAB = 300  # not a multiple of 128: Megatron pads the embedding rows, the export must trim them
NEW_TOKENS = 12
MAX_MODEL_LEN = 64
MAX_SHARD_BYTES = 100_000  # a few tensors per shard: the export is an index + many shard files
SHARED = dict(
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    bos_token_id=1,
    eos_token_id=2,
    # With the default std 0.02 these models echo the last prompt token forever (tied embeddings
    # dominate), which would prove little; 0.4 gives varied continuations with clear argmax margins.
    initializer_range=0.4,
    # vLLM's CPU attention supports head_dim 32, 64, 80, ...; 16 is refused, hence hidden 128 / 4 heads.
    hidden_size=128,
    max_position_embeddings=128,
)
_gen = torch.Generator().manual_seed(1)
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=_gen).tolist() for n in (5, 7, 8, 9)]
# The greedy path must never pass near a tie, or a mismatch could be rounding rather than a bug.
MIN_ARGMAX_MARGIN = 1e-3
# vLLM's CPU kernels sum in another order than torch's; fp32 rounding stays far below this.
LOGPROB_ATOL = 1e-3


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**SHARED, tie_word_embeddings=False))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(
        **{**SHARED, "max_position_embeddings": 16384}, tie_word_embeddings=True, rope_parameters=rope
    )
    return LlamaForCausalLM(config)


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim * heads (128) != hidden (64): Megatron's kv_channels path.
    return Qwen3ForCausalLM(
        Qwen3Config(**{**SHARED, "hidden_size": 64}, head_dim=32, tie_word_embeddings=True)
    )


_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **{**SHARED, "hidden_size": 64}, **_MOE, norm_topk_prob=True, head_dim=32, tie_word_embeddings=False
    )
    return Qwen3MoeForCausalLM(config)


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        **SHARED, **_MOE, norm_topk_prob=False, shared_expert_intermediate_size=48, tie_word_embeddings=False
    )
    return Qwen2MoeForCausalLM(config)


ARCHS: dict[str, Callable[[], torch.nn.Module]] = {
    "qwen2": _qwen2,
    "llama": _llama,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
}
# Mixture-of-experts models are converted with their experts split over EP ranks as well (ep, etp).
EXPERT_PARALLEL = {"qwen3_moe": (2, 1), "qwen2_moe": (2, 2)}
WITH_TOKENIZER = "qwen2"


def _randomize_norms_and_biases(model: torch.nn.Module) -> None:
    """Norm weights of 1 and biases of 0 would hide a swapped or dropped mapping; make each distinct."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)


def _save_tokenizer(out: Path) -> None:
    """A word-level tokenizer over exactly VOCAB ids ("w<id>"), saved as tokenizer.json + config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(out)


@dataclass(frozen=True)
class Exported:
    source: Path
    """The HF directory transformers saved."""
    export: Path
    """``megatron_to_hf`` of ``hf_to_megatron(source, tp=2)`` (with ``EXPERT_PARALLEL``'s ``ep``, ``etp``
    for the MoE models)."""


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Exported]:
    root = tmp_path_factory.mktemp("vllm_export")
    out = {}
    for name, build in ARCHS.items():
        torch.manual_seed(0)
        model = build().float()
        _randomize_norms_and_biases(model)
        source = root / name
        model.save_pretrained(source)  # safetensors
        if name == WITH_TOKENIZER:
            _save_tokenizer(source)
        ep, etp = EXPERT_PARALLEL.get(name, (1, None))
        ckpt = hf_to_megatron(source, root / f"{name}-megatron", tp=2, ep=ep, etp=etp)
        export = megatron_to_hf(ckpt, root / f"{name}-export", max_shard_bytes=MAX_SHARD_BYTES)
        out[name] = Exported(source, export)
    return out


@dataclass(frozen=True)
class Greedy:
    tokens: list[list[int]]
    """Per prompt, the NEW_TOKENS greedy continuation."""
    logprobs: list[list[float]]
    """Per prompt and step, log-softmax of the raw logits at the chosen token."""
    margins: list[list[float]]
    """Per prompt and step, top-1 minus top-2 logit."""


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(exported) -> dict[str, Greedy]:
    out = {}
    for name, paths in exported.items():
        model = _load(paths.source)
        tokens, logprobs, margins = [], [], []
        for prompt in PROMPTS:
            with torch.no_grad():
                # eos_token_id=None: no early stop (as vLLM's ignore_eos) and no EOS masking (unlike
                # min_new_tokens, which would change the argmax whenever EOS wins).
                gen = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            new = gen.sequences[0, len(prompt) :]
            assert len(new) == NEW_TOKENS
            logits_SV = torch.cat(gen.logits).float()  # [steps, vocab]
            top2_S2 = logits_SV.topk(2, dim=-1).values
            tokens.append(new.tolist())
            logprobs.append(logits_SV.log_softmax(-1).gather(1, new[:, None])[:, 0].tolist())
            margins.append((top2_S2[:, 0] - top2_S2[:, 1]).tolist())
        out[name] = Greedy(tokens, logprobs, margins)
    return out


@pytest.fixture(scope="module")
def vllm_greedy(exported, tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("vllm_run")
    jobs = [
        {
            "name": name,
            "model": str(paths.export),
            "load_tokenizer": name == WITH_TOKENIZER,
            "prompts": PROMPTS,
            "max_tokens": NEW_TOKENS,
            "max_model_len": MAX_MODEL_LEN,
        }
        for name, paths in exported.items()
    ]
    (work / "jobs.json").write_text(json.dumps(jobs))
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the helper process itself
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the CPU default would reserve far more
        "TOKENIZERS_PARALLELISM": "false",
    }
    helper = Path(__file__).with_name("_vllm_greedy.py")
    proc = subprocess.run(
        [sys.executable, str(helper), str(work / "jobs.json"), str(work / "out.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"vLLM helper failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads((work / "out.json").read_text())


def test_export_is_sharded_and_carries_the_tokenizer(exported):
    for name, paths in exported.items():
        assert (paths.export / "model.safetensors.index.json").is_file(), name
        index = json.loads((paths.export / "model.safetensors.index.json").read_text())
        shards = sorted(paths.export.glob("model-*-of-*.safetensors"))
        assert len(shards) >= 2, name
        assert sorted(set(index["weight_map"].values())) == [s.name for s in shards], name
        assert json.loads((paths.export / "config.json").read_text()) == json.loads(
            (paths.source / "config.json").read_text()
        ), name
    qwen2 = exported[WITH_TOKENIZER].export
    assert (qwen2 / "tokenizer.json").is_file()
    assert (qwen2 / "tokenizer_config.json").is_file()


def test_transformers_gives_identical_logits_on_export(exported):
    tokens = torch.tensor([PROMPTS[-1]])
    for name, paths in exported.items():
        with torch.no_grad():
            source, export = _load(paths.source)(tokens).logits, _load(paths.export)(tokens).logits
        assert torch.equal(source, export), f"{name}: max |diff| {(source - export).abs().max().item()}"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_vllm_greedy_matches_transformers(arch, exported, hf_greedy, vllm_greedy):
    ref, got = hf_greedy[arch], vllm_greedy[arch]
    closest = min(min(m) for m in ref.margins)
    assert closest > MIN_ARGMAX_MARGIN, f"{arch}: fixture decodes through a near-tie ({closest:.2e})"
    for i, prompt in enumerate(PROMPTS):
        assert got["tokens"][i] == ref.tokens[i], (
            f"{arch}, prompt {prompt}: vLLM {got['tokens'][i]} != transformers {ref.tokens[i]}"
        )
        diff = max(abs(a - b) for a, b in zip(got["logprobs"][i], ref.logprobs[i], strict=True))
        assert diff < LOGPROB_ATOL, f"{arch}, prompt {prompt}: chosen-token logprobs differ by {diff:.2e}"
    if got["text"] is not None:
        # vLLM loaded the exported tokenizer files. transformers 5 loads them as Qwen2Tokenizer (from
        # config.json's model_type), byte-level decoder included, so words come back unspaced; vLLM
        # goes through the same AutoTokenizer, so the reference is transformers' decode of its tokens.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(exported[arch].export)
        assert got["text"] == [tokenizer.decode(t, skip_special_tokens=True) for t in ref.tokens]
