"""DeepInfer's model runner against Hugging Face transformers on the same checkpoints.

The runner is driven directly with hand-built sequences and chunks; block ids come from a
shuffled pool so pages are scattered, as they are under a real block manager. The reference is
transformers' full (uncached) forward over each sequence.

Tolerances (float32, CPU): tiny models' logits have std ~4-10 and match to ~2e-5 absolute;
SmolLM2-135M (logits up to ~30) to ~1e-4. We assert 2e-4 and 1e-3 respectively.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.deepinfer.config import EngineConfig
from backends.deepinfer.layers.attention import Attention
from backends.deepinfer.layers.rotary import RotaryEmbedding
from backends.deepinfer.model_runner import ModelRunner
from backends.deepinfer.outputs import ScheduledChunk, SchedulerOutput
from backends.deepinfer.sequence import Sequence
from backends.deepinfer.tiny import Arch, build_checkpoint
from orchestrator.runtime.protocol import WorkerRequest
from tests.deepinfer.device import DEVICE, DTYPE

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
TINY_ATOL = 2e-4
PROMPT_LENGTHS = (5, 13, 1, 9, 4)


class Blocks:
    """A trivial block assignment: each sequence gets enough blocks from a shuffled pool."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.block_size = runner.block_size
        self.free = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free)

    def ensure(self, seq: Sequence, length: int) -> None:
        while len(seq.block_table) * self.block_size < length:
            seq.block_table.append(self.free.pop())


def make_runner(model_dir: Path, **overrides: Any) -> ModelRunner:
    fields: dict[str, Any] = {
        "model": str(model_dir),
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": 512,
        "device": DEVICE,
        "dtype": DTYPE,
    }
    fields.update(overrides)
    return ModelRunner(EngineConfig(**fields))


def make_seqs(prompts: list[list[int]]) -> list[Sequence]:
    return [
        Sequence(WorkerRequest(request_id=f"r{i}", token_ids=p, max_tokens=64)) for i, p in enumerate(prompts)
    ]


def random_prompts(vocab: int, lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def reference(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def reference_last_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0, -1].float()


def step(runner: ModelRunner, blocks: Blocks, chunks: list[tuple[Sequence, int, int, bool]]) -> torch.Tensor:
    for seq, start, num, _ in chunks:
        blocks.ensure(seq, start + num)
    return runner.execute(
        SchedulerOutput([ScheduledChunk(s, start, n, sample) for s, start, n, sample in chunks])
    ).cpu()  # the references are on the CPU (a no-op there)


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Generate `steps` tokens for all prompts together: one batched prefill, then decodes."""
    seqs, blocks = make_seqs(prompts), Blocks(runner)
    logits = step(runner, blocks, [(s, 0, len(s.token_ids), True) for s in seqs])
    for _ in range(steps - 1):
        for seq, row in zip(seqs, logits, strict=True):
            seq.token_ids.append(int(row.argmax()))
        logits = step(runner, blocks, [(s, len(s.token_ids) - 1, 1, True) for s in seqs])
    for seq, row in zip(seqs, logits, strict=True):
        seq.token_ids.append(int(row.argmax()))
    return [s.token_ids[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


TINY_CASES: dict[str, tuple[Arch, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied-llama3-rope": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-mha-linear-rope": (
        "llama",
        {"num_key_value_heads": 4, "rope_scaling": {"type": "linear", "factor": 2.0}},
    ),
    "llama-dynamic-rope": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),  # q/k norm, head_dim 32 != 64 / 4 heads, tied
    "qwen3_moe": ("qwen3_moe", {}),  # a dense layer, then softmax top-2 of 8 experts
    "qwen3_moe-unnormalized-every-other": (
        "qwen3_moe",
        {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []},
    ),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3-no-q-lora-yarn": (
        "deepseek_v3",
        {
            "q_lora_rank": None,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 512,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(TINY_CASES))
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = TINY_CASES[request.param]
    return build_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


def assert_decoding_matches(
    runner: ModelRunner, ref: Any, prompts: list[list[int]], steps: int
) -> list[Sequence]:
    """The prompts prefilled together, then `steps` greedy decode steps: every step's logits are
    transformers' for the same tokens. Returns the sequences, grown by their tokens."""
    seqs, blocks = make_seqs(prompts), Blocks(runner)
    logits = step(runner, blocks, [(s, 0, len(s.token_ids), True) for s in seqs])
    for _ in range(steps):
        assert logits.dtype == torch.float32 and logits.shape == (len(seqs), runner.vocab_size)
        for seq, row in zip(seqs, logits, strict=True):
            torch.testing.assert_close(row, reference_last_logits(ref, seq.token_ids), atol=TINY_ATOL, rtol=0)
            seq.token_ids.append(int(row.argmax()))
        logits = step(runner, blocks, [(s, len(s.token_ids) - 1, 1, True) for s in seqs])
    return seqs


def test_prefill_and_decode_logits_match_transformers(tiny_dir: Path) -> None:
    runner = make_runner(tiny_dir)
    assert_decoding_matches(runner, reference(tiny_dir), random_prompts(runner.vocab_size), 4)


def test_greedy_32_tokens_match_transformers_generate(tiny_dir: Path) -> None:
    runner, ref = make_runner(tiny_dir), reference(tiny_dir)
    prompts = random_prompts(runner.vocab_size, (7, 3, 12), seed=1)
    ours = greedy(runner, prompts, 32)
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None)
        assert tokens == out[0, len(prompt) :].tolist()


def test_chunked_prefill_in_a_mixed_batch_gives_the_same_logits(tiny_llama_dir: Path) -> None:
    runner = make_runner(tiny_llama_dir)
    long, short = random_prompts(runner.vocab_size, (11, 6), seed=2)
    whole = make_seqs([long])[0]
    expected = step(runner, Blocks(runner, seed=5), [(whole, 0, 11, True)])[0]

    blocks = Blocks(runner, seed=6)
    chunked, other = make_seqs([long, short])
    # Step 1: the first 7 tokens of `chunked` (not sampled) next to a full prefill of `other`.
    first = step(runner, blocks, [(chunked, 0, 7, False), (other, 0, 6, True)])
    assert first.shape[0] == 1  # only the sampled chunk has logits
    other.token_ids.append(int(first[0].argmax()))
    # Step 2: a decode of `other`, then the rest of `chunked`, in one batch.
    second = step(runner, blocks, [(other, 6, 1, True), (chunked, 7, 4, True)])
    torch.testing.assert_close(second[1], expected, atol=TINY_ATOL, rtol=0)


def assert_a_changing_batch_matches(
    runner: ModelRunner, ref: Any, prompts: list[list[int]], steps: int
) -> None:
    """The prompts but the third prefill together and decode `steps` times; the third joins
    with its prefill after 3 steps, the first leaves after 7, the rest change places after
    10. Every step's logits are transformers' for the same tokens."""
    seqs = make_seqs(prompts)
    joining = seqs[2]
    batch: list[Sequence] = [seqs[0], seqs[1], *seqs[3:]]
    blocks = Blocks(runner, seed=8)
    logits = step(runner, blocks, [(s, 0, len(s.token_ids), True) for s in batch])
    for i in range(steps):
        for seq, row in zip(batch, logits, strict=True):
            torch.testing.assert_close(row, reference_last_logits(ref, seq.token_ids), atol=TINY_ATOL, rtol=0)
            seq.token_ids.append(int(row.argmax()))
        chunks = [(s, len(s.token_ids) - 1, 1, True) for s in batch]
        if i == 2:  # the third joins with its prefill; it decodes from the next step on
            chunks.append((joining, 0, len(joining.token_ids), True))
            batch = [*batch, joining]
        elif i == 6:  # the first leaves
            chunks, batch = chunks[1:], batch[1:]
        elif i == 9:  # the others change places
            chunks, batch = chunks[::-1], batch[::-1]
        logits = step(runner, blocks, chunks)


def test_decode_batch_that_changes_every_few_steps_matches_transformers(tiny_llama_dir: Path) -> None:
    """The decode workspaces carry rows over between steps: sequences joining, leaving and
    changing places, and contexts outgrowing the workspace, must all read the right K/V."""
    runner, ref = make_runner(tiny_llama_dir), reference(tiny_llama_dir)
    prompts = random_prompts(runner.vocab_size, (5, 13, 9), seed=3)
    assert_a_changing_batch_matches(runner, ref, prompts, 40)  # 13 + 40: past the workspace's 8 spare blocks


def test_a_changing_batch_updates_the_decode_workspace_in_place(tiny_llama_dir: Path) -> None:
    """The eager decode workspaces are reallocated only to grow: a sequence leaving the batch
    moves one row of the same tensors, where each change once rebuilt them whole; and when
    the contexts outgrow them, the new ones have the batch's rows, not the most it had."""
    runner = make_runner(tiny_llama_dir, enforce_eager=True)
    layer = next(m for m in runner.model.modules() if isinstance(m, Attention))
    seqs, blocks = make_seqs(random_prompts(runner.vocab_size, (5, 7, 6), seed=5)), Blocks(runner)
    logits = step(runner, blocks, [(s, 0, len(s.token_ids), True) for s in seqs])

    def decode(batch: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        for seq, row in zip(batch, logits, strict=True):
            seq.token_ids.append(int(row.argmax()))
        return step(runner, blocks, [(s, len(s.token_ids) - 1, 1, True) for s in batch])

    logits = decode(seqs, logits)  # the first decode step allocates the workspaces
    workspace = layer.k_decode
    logits = decode(seqs, logits)
    logits, batch = logits[1:], seqs[1:]  # the first sequence leaves
    logits = decode(batch, logits)
    assert layer.k_decode is workspace and workspace.shape[0] == 3
    while layer.k_decode.shape[2] == workspace.shape[2]:
        logits = decode(batch, logits)
    assert layer.k_decode.shape[0] == 2


def test_prefill_over_shared_prefix_blocks(tiny_llama_dir: Path) -> None:
    """What prefix caching hands the runner: a new sequence whose first blocks are another's
    (already computed), and a chunk that starts after them."""
    runner, ref = make_runner(tiny_llama_dir), reference(tiny_llama_dir)
    first, tail = random_prompts(runner.vocab_size, (12, 5), seed=4)
    owner = make_seqs([first])[0]
    blocks = Blocks(runner, seed=7)
    step(runner, blocks, [(owner, 0, 12, True)])
    sharer = make_seqs([first[:8] + tail])[0]
    sharer.block_table = owner.block_table[:2]  # 8 cached tokens = 2 blocks of 4
    logits = step(runner, blocks, [(sharer, 8, 5, True)])
    torch.testing.assert_close(
        logits[0], reference_last_logits(ref, sharer.token_ids), atol=TINY_ATOL, rtol=0
    )


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_bfloat16_is_as_close_to_float32_as_the_reference_in_bfloat16(
    name: str, tiny_llama_dir: Path, tiny_deepseek_dir: Path
) -> None:
    model_dir = tiny_llama_dir if name == "llama" else tiny_deepseek_dir
    runner = make_runner(model_dir, dtype="bfloat16")
    ref32 = reference(model_dir)
    ref16 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    prompts = random_prompts(runner.vocab_size)
    logits = step(runner, Blocks(runner), [(s, 0, len(s.token_ids), True) for s in make_seqs(prompts)])
    exact = torch.stack([reference_last_logits(ref32, p) for p in prompts])
    theirs = torch.stack([reference_last_logits(ref16, p) for p in prompts])
    # Measured: ours 0.13 / 0.25 off float32, transformers' bfloat16 0.14 / 0.24.
    assert (logits - exact).abs().max() <= 1.5 * (theirs - exact).abs().max() + 0.05


@pytest.mark.parametrize("name", ["tiny_llama_dir", "tiny_deepseek_dir", "tiny_qwen3_moe_dir"])
def test_loads_a_checkpoint_saved_by_transformers(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """transformers 5 writes `rope_parameters` instead of `rope_theta`/`rope_scaling`, and
    stores experts as it converted them on loading."""
    ref = reference(request.getfixturevalue(name))
    ref.save_pretrained(tmp_path)
    runner = make_runner(tmp_path)
    prompts = random_prompts(runner.vocab_size, (6, 10), seed=8)
    logits = step(runner, Blocks(runner), [(s, 0, len(s.token_ids), True) for s in make_seqs(prompts)])
    for row, prompt in zip(logits, prompts, strict=True):
        torch.testing.assert_close(row, reference_last_logits(ref, prompt), atol=TINY_ATOL, rtol=0)


_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [1.0 + 0.7 * i for i in range(8)],
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize(
    ("rope", "trained", "max_model_len", "length"),
    [
        # Dynamic NTK scaled for a context of 32 (twice the trained 16): transformers scales
        # for the longest position of its forward, so a 32-token prompt is the same.
        ({"rope_type": "dynamic", "factor": 2.0}, 16, 32, 32),
        # longrope: short factors within the default context (the trained 16 positions)...
        (_LONGROPE, 32, None, 12),
        # ...its long ones once a longer context is asked for, as transformers past 16.
        (_LONGROPE, 32, 32, 24),
    ],
)
def test_context_dependent_rope_matches_transformers_where_they_agree(
    rope: dict[str, Any], trained: int, max_model_len: int | None, length: int, tmp_path: Path
) -> None:
    model_dir = build_checkpoint(tmp_path, "llama", max_position_embeddings=trained, rope_scaling=rope)
    runner = make_runner(model_dir, **({"max_model_len": max_model_len} if max_model_len else {}))
    assert runner.max_model_len == (max_model_len or 16)
    prompt = random_prompts(runner.vocab_size, (length,), seed=5)[0]
    logits = step(runner, Blocks(runner), [(s, 0, length, True) for s in make_seqs([prompt])])
    torch.testing.assert_close(
        logits[0], reference_last_logits(reference(model_dir), prompt), atol=TINY_ATOL, rtol=0
    )


def test_deterministic_mode_logits_ignore_the_batch(tiny_llama_dir: Path) -> None:
    runner = make_runner(tiny_llama_dir, deterministic=True)
    prompts = random_prompts(runner.vocab_size, (9, 5, 14, 2, 8), seed=3)
    alone = greedy(runner, prompts[:1], 6)
    together = greedy(runner, prompts, 6)
    assert together[0] == alone[0]

    # Logits, bit for bit: the same sequence decoded alone and beside others.
    blocks = Blocks(runner)
    solo, *others = make_seqs(prompts)
    twin = make_seqs(prompts[:1])[0]
    step(runner, blocks, [(solo, 0, len(solo.token_ids), False), (twin, 0, len(twin.token_ids), False)])
    step(runner, blocks, [(s, 0, len(s.token_ids), False) for s in others])
    a = step(runner, blocks, [(solo, len(solo.token_ids) - 1, 1, True)])[0]
    b = step(runner, blocks, [(s, len(s.token_ids) - 1, 1, True) for s in [*others[:2], twin, *others[2:]]])[
        2
    ]
    assert torch.equal(a, b)


def test_cpu_linear_layers_multiply_by_onednn_as_f_linear_does(
    tiny_qwen2_dir: Path, tiny_deepseek_dir: Path
) -> None:
    """On a CPU the runner repacks every linear layer's weight for oneDNN and frees the plain
    one (the logits tests above run through it); a tied head keeps the embedding's weight, and
    MLA's kv_b_proj, whose weight decode reads whole, stays plain."""
    import torch.nn.functional as F

    from backends.deepinfer.layers.embed import LMHead
    from backends.deepinfer.layers.linear import Linear, pack_weight, packed_linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    qwen2 = make_runner(tiny_qwen2_dir, device="cpu").model  # tied embeddings
    linears = [m for m in qwen2.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    head = qwen2.lm_head
    assert isinstance(head, LMHead) and head.packed is not None
    assert head.weight is qwen2.model.embed_tokens.weight and head.weight.numel() > 0
    mla = make_runner(tiny_deepseek_dir, device="cpu").model.model.layers[0].self_attn
    assert mla.kv_b_proj.packed is None and mla.kv_b_proj.weight.numel() > 0
    assert mla.o_proj.packed is not None
    weight, bias = torch.randn(96, 64), torch.randn(96)
    for rows in (0, 1, 7, 300):
        x = torch.randn(rows, 64)
        plain = F.linear(x, weight, bias)
        torch.testing.assert_close(packed_linear(x, pack_weight(weight), bias), plain, rtol=1e-5, atol=1e-5)


def test_kv_cache_size_and_bytes_per_token(tiny_llama_dir: Path, tiny_deepseek_dir: Path) -> None:
    llama = make_runner(tiny_llama_dir, num_kv_blocks=0, kv_cache_memory_gb=0.001, max_num_seqs=4)
    config = llama.hf_config
    expected = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert llama.kv_bytes_per_token == expected
    assert llama.num_kv_blocks == min(2**30 // 1000 // (expected * BLOCK_SIZE), 4 * 2048 // BLOCK_SIZE)
    mla = make_runner(tiny_deepseek_dir)
    c = mla.hf_config
    assert mla.kv_bytes_per_token == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4


def test_the_layers_share_one_rotary_table(tiny_llama_dir: Path, tiny_deepseek_dir: Path) -> None:
    """A table per layer would cost the layer count times its memory (67 MB each at a 128k
    context and 128-wide heads), and every layer rotates by the same angles."""
    for model_dir in (tiny_llama_dir, tiny_deepseek_dir):
        model = make_runner(model_dir).model
        tables = {id(m) for m in model.modules() if isinstance(m, RotaryEmbedding)}
        assert len(tables) == 1, model_dir.name


def test_bad_inputs_are_clear_errors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    runner = make_runner(tiny_llama_dir)
    (seq,) = make_seqs([[5, 6, 7, 8, 9]])
    seq.block_table = [0]  # 4 slots for 5 tokens
    with pytest.raises(ValueError, match="1 blocks for 5 tokens"):
        runner.execute(SchedulerOutput([ScheduledChunk(seq, 0, 5, True)]))
    with pytest.raises(ValueError, match="bad chunk"):
        runner.execute(SchedulerOutput([ScheduledChunk(seq, 3, 4, True)]))
    broken = build_checkpoint(tmp_path, "llama", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture"):
        make_runner(broken)


def test_loader_rejects_incomplete_or_foreign_checkpoints(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = build_checkpoint(tmp_path, "llama")
    weights = load_file(model_dir / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}, model_dir / "model.safetensors"
    )
    with pytest.raises(ValueError, match=r"lacks weights for \['model.layers.1.mlp.gate_up_proj.weight'\]"):
        make_runner(model_dir)
    save_file({**weights, "model.extra.weight": torch.zeros(2)}, model_dir / "model.safetensors")
    with pytest.raises(KeyError, match=r"model\.extra\.weight"):
        make_runner(model_dir)


def test_deepseek_maps_experts_and_mtp_layers_only_when_asked(tmp_path: Path) -> None:
    from backends.deepinfer.hf_config import HFConfig
    from backends.deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM

    model_dir = build_checkpoint(tmp_path, "deepseek_v3", num_nextn_predict_layers=1)
    config = HFConfig.load(model_dir)
    model = DeepseekV3ForCausalLM(config, max_positions=16)
    layers = model.config.num_hidden_layers
    assert model.weight_target(f"model.layers.{layers}.eh_proj.weight") is None
    with_mtp = DeepseekV3ForCausalLM(config, max_positions=16, mtp_layers=1)
    mtp = f"model.layers.{layers}"
    assert with_mtp.weight_target(f"{mtp}.eh_proj.weight") == ("mtp.0.eh_proj.weight", None)
    assert with_mtp.weight_target(f"{mtp}.shared_head.head.weight") == ("mtp.0.shared_head.head.weight", None)
    assert with_mtp.weight_target(f"{mtp}.embed_tokens.weight") == ("mtp.0.embed_tokens.weight", None)
    assert with_mtp.weight_target(f"{mtp}.self_attn.kv_b_proj.weight") == (
        "mtp.0.block.self_attn.kv_b_proj.weight",
        None,
    )
    assert with_mtp.weight_target(f"{mtp}.mlp.experts.3.down_proj.weight") == (
        "mtp.0.block.mlp.experts.w2",
        (3, "down"),
    )
    assert with_mtp.weight_target(f"{mtp}.mlp.shared_experts.up_proj.weight") == (
        "mtp.0.block.mlp.shared_experts.gate_up_proj.weight",
        "up",
    )
    assert with_mtp.weight_target(f"model.layers.{layers + 1}.eh_proj.weight") is None  # a second, unused
    assert model.weight_target("model.layers.2.mlp.experts.5.up_proj.weight") == (
        "model.layers.2.mlp.experts.w13",
        (5, "up"),
    )
    assert model.weight_target("model.layers.0.mlp.gate_proj.weight") == (
        "model.layers.0.mlp.gate_up_proj.weight",
        "gate",
    )
    assert model.weight_target("model.layers.1.self_attn.q_a_proj.weight") == (
        "model.layers.1.self_attn.q_a_proj.weight",
        None,
    )


@pytest.mark.slow
def test_smollm2_matches_transformers_reading_the_gguf(smollm2_dir: Path) -> None:
    from backends.deepinfer.smollm2 import GGUF_FILE, gguf_path

    runner = make_runner(smollm2_dir, block_size=16, num_kv_blocks=64)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path().parent, gguf_file=GGUF_FILE, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False),
        tokenizer("The quick brown fox").input_ids,
        tokenizer("def fibonacci(n):").input_ids,
    ]
    prompts = [list(p) for p in prompts]
    seqs, blocks = make_seqs(prompts), Blocks(runner)
    logits = step(runner, blocks, [(s, 0, len(s.token_ids), True) for s in seqs])
    for _ in range(3):
        for seq, row in zip(seqs, logits, strict=True):
            torch.testing.assert_close(row, reference_last_logits(ref, seq.token_ids), atol=1e-3, rtol=0)
            seq.token_ids.append(int(row.argmax()))
        logits = step(runner, blocks, [(s, len(s.token_ids) - 1, 1, True) for s in seqs])
    ours = greedy(runner, prompts[:2], 32)
    for prompt, tokens in zip(prompts[:2], ours, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None)
        assert tokens == out[0, len(prompt) :].tolist()
    assert "Paris" in tokenizer.decode(ours[0])
