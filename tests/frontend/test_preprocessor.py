"""Preprocessor against transformers on the same tokenizer directories: prompts, ids, BOS, errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from backends.deepinfer import tiny
from orchestrator.frontend.preprocessor import Preprocessor
from tests.frontend.tokenizer_dirs import build_chatml, build_llama

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France? 日本語 é 🎉"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Italy?"},
    ],
    [{"role": "user", "content": "  spaces and\nnewlines\t"}],
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "chatml": build_chatml(root / "chatml"),
        "llama": build_llama(root / "llama"),
        "tiny": tiny.build_tokenizer(root / "tiny"),  # the tokenizer of DeepInfer's test checkpoints
    }


@pytest.mark.parametrize("kind", ["chatml", "llama", "tiny"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_prompt_and_ids_match_transformers(
    dirs: dict[str, Path], kind: str, conversation: int, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    reference = AutoTokenizer.from_pretrained(str(dirs[kind]))
    pre = Preprocessor.load(dirs[kind])
    prompt = pre.render_chat(messages, add_generation_prompt=add_generation_prompt)
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert prompt == expected
    expected_ids = reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert pre.encode(prompt, add_special_tokens=False) == list(expected_ids)


def test_template_kwargs_reach_the_template(dirs: dict[str, Path]) -> None:
    tools: list[dict[Any, Any] | Callable[..., Any]] = [
        {"type": "function", "function": {"name": "weather", "description": "Météo <b>"}}
    ]
    reference = AutoTokenizer.from_pretrained(str(dirs["llama"]))
    prompt = Preprocessor.load(dirs["llama"]).render_chat(CONVERSATIONS[0], tools=tools)
    assert prompt == reference.apply_chat_template(CONVERSATIONS[0], tools=tools, tokenize=False)
    # tojson as transformers defines it: no HTML escaping, non-ASCII kept.
    assert '"Météo <b>"' in prompt


def test_text_parts_are_joined_and_other_parts_rejected(dirs: dict[str, Path]) -> None:
    pre = Preprocessor.load(dirs["chatml"])
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    joined = pre.render_chat([{"role": "user", "content": parts}])
    assert joined == pre.render_chat([{"role": "user", "content": "first\nsecond"}])
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    with pytest.raises(ValueError, match="image_url"):
        pre.render_chat([{"role": "user", "content": [image]}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "no role"}], "role"),
        ([{"role": "user", "content": 42}], "content"),
        ([{"role": "user", "content": [{"type": "text", "text": None}]}], "text must be a string"),
    ],
)
def test_malformed_messages_raise_value_error(dirs: dict[str, Path], messages: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Preprocessor.load(dirs["chatml"]).render_chat(messages)


def test_template_raise_exception_becomes_value_error(dirs: dict[str, Path]) -> None:
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        Preprocessor.load(dirs["llama"]).render_chat(two_users)


def test_template_runs_sandboxed(tmp_path: Path) -> None:
    model = build_chatml(tmp_path / "evil")
    (model / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template"):
        Preprocessor.load(model).render_chat([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_wins_over_config(tmp_path: Path) -> None:
    model = build_chatml(tmp_path / "m")
    (model / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    assert Preprocessor.load(model).render_chat(CONVERSATIONS[1]) == "[system][user][assistant][user]"


def test_model_without_template_rejects_chat(tmp_path: Path) -> None:
    model = build_chatml(tmp_path / "m")
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Preprocessor.load(model).render_chat(CONVERSATIONS[0])


@pytest.mark.parametrize("kind", ["chatml", "llama", "tiny"])
@pytest.mark.parametrize("text", ["Hello world", "日本語 é 🎉 mixed ascii", "a\n\tb  c", "x" * 300])
def test_round_trip_and_ids_match_transformers(dirs: dict[str, Path], kind: str, text: str) -> None:
    reference = AutoTokenizer.from_pretrained(str(dirs[kind]))
    pre = Preprocessor.load(dirs[kind])
    ids = pre.encode(text, add_special_tokens=True)
    assert ids == reference.encode(text, add_special_tokens=True)
    assert pre.decode(ids) == text
    assert pre.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_bos_is_not_added_twice(dirs: dict[str, Path]) -> None:
    pre = Preprocessor.load(dirs["llama"])
    bos = pre.encode("", add_special_tokens=True)
    assert len(bos) == 1
    assert pre.encode("<s>Hello", add_special_tokens=True) == pre.encode("Hello", add_special_tokens=True)
    assert pre.encode("Hello", add_special_tokens=True)[:2].count(bos[0]) == 1
    prompt = pre.render_chat(CONVERSATIONS[0])
    assert pre.encode(prompt, add_special_tokens=False).count(bos[0]) == 1


def test_special_tokens_and_eos_ids(dirs: dict[str, Path]) -> None:
    chatml = Preprocessor.load(dirs["chatml"])
    # <|im_end|> from tokenizer_config.json, then generation_config.json's extra <|endoftext|>.
    assert chatml.eos_token_ids == [
        chatml.tokenizer.token_to_id("<|im_end|>"),
        chatml.tokenizer.token_to_id("<|endoftext|>"),
    ]
    assert chatml.special_tokens["eos_token"] == "<|im_end|>"
    llama = Preprocessor.load(dirs["llama"])
    assert llama.eos_token_ids == [llama.tokenizer.token_to_id("</s>")]
    assert llama.vocab_size == len(AutoTokenizer.from_pretrained(str(dirs["llama"])))


def test_token_text(dirs: dict[str, Path]) -> None:
    pre = Preprocessor.load(dirs["chatml"])
    hello = pre.encode("Hello", add_special_tokens=False)
    assert "".join(pre.token_text(i) for i in hello) == "Hello"
    assert pre.token_text(pre.eos_token_ids[0]) == "<|im_end|>"
    # A lone byte of a multi-byte character is not valid text on its own.
    assert pre.token_text(pre.encode("日", add_special_tokens=False)[0]) == "\ufffd"


def test_load_is_cached_per_path_and_checks_the_directory(dirs: dict[str, Path], tmp_path: Path) -> None:
    assert Preprocessor.load(dirs["chatml"]) is Preprocessor.load(str(dirs["chatml"]) + "/.")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Preprocessor.load(tmp_path)


@pytest.mark.slow
def test_smollm2_matches_transformers() -> None:
    """The default model's tokenizer, converted from its GGUF, against transformers reading the same files."""
    from backends.deepinfer.smollm2 import ensure_default_model

    model = ensure_default_model()
    reference = AutoTokenizer.from_pretrained(str(model))
    pre = Preprocessor.load(model)
    for messages in CONVERSATIONS:
        prompt = pre.render_chat(messages)
        assert prompt == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert pre.encode(prompt, add_special_tokens=False) == list(
            reference.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True, return_dict=False
            )
        )
    text = "What is the capital of France? 日本語 🎉"
    ids = pre.encode(text, add_special_tokens=True)
    assert ids == reference.encode(text, add_special_tokens=True)
    detok = pre.detokenizer()
    assert "".join(detok.step([i]) for i in ids) == text
    assert reference.convert_ids_to_tokens(pre.eos_token_ids[0]) == "<|im_end|>"
