"""The locally built checkpoints: the SmolLM2 conversion and the tiny random models."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from backends.deepinfer.smollm2 import GGUF_FILE, ensure_default_model, gguf_path
from backends.deepinfer.tiny import Arch, build_checkpoint

TEXTS = [
    "What is the capital of France?",
    "Hello world, <|im_start|> it's 2024!\n\n\tTabs,  double  spaces, ünïcödé 日本語 🙂 and <|im_end|>",
    "def f(x):\n    return x ** 2  # comment",
]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "deepseek_v3"])
def test_tiny_checkpoint_is_deterministic_and_loads_in_transformers(tmp_path: Path, arch: Arch) -> None:
    transformers = pytest.importorskip("transformers")
    first = build_checkpoint(tmp_path / "a", arch, seed=3)
    second = build_checkpoint(tmp_path / "b", arch, seed=3)
    other = build_checkpoint(tmp_path / "c", arch, seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(first / name) == _digest(second / name)
    assert _digest(first / "model.safetensors") != _digest(other / "model.safetensors")

    model, info = transformers.AutoModelForCausalLM.from_pretrained(first, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokenizer = transformers.AutoTokenizer.from_pretrained(first)
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(TEXTS[0]).input_ids
    assert tokenizer.decode(ids) == TEXTS[0]
    assert max(ids) < model.config.vocab_size


def test_tiny_overrides_reach_config(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = build_checkpoint(tmp_path, "llama", hidden_size=32, num_hidden_layers=1, tie_word_embeddings=True)
    config = transformers.AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers, config.tie_word_embeddings) == (32, 1, True)


@pytest.mark.slow
def test_smollm2_conversion_matches_transformers_gguf_loader(smollm2_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    source = gguf_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=GGUF_FILE, dtype=torch.float32
    )
    ours = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ref_state, our_state = reference.state_dict(), ours.state_dict()
    assert ref_state.keys() == our_state.keys()
    for name, tensor in ref_state.items():
        assert torch.equal(tensor, our_state[name]), name  # same dequantization, same Q/K unpermute

    ref_tok = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=GGUF_FILE)
    our_tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    for text in TEXTS:
        assert our_tok(text).input_ids == ref_tok(text).input_ids, text
    messages = [{"role": "user", "content": TEXTS[0]}]
    assert our_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        ref_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    assert (our_tok.bos_token, our_tok.eos_token) == (ref_tok.bos_token, ref_tok.eos_token)


@pytest.mark.slow
def test_smollm2_conversion_is_idempotent(smollm2_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    assert ensure_default_model(smollm2_dir.parent.parent) == smollm2_dir
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before


@pytest.mark.slow
def test_a_first_conversion_is_silent_when_stderr_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        gguf_path()
    except FileNotFoundError as exc:  # the package is an optional install (--no-deps)
        pytest.skip(str(exc))
    ensure_default_model(tmp_path)  # converts: the cache is new
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "")
