"""Tokenizer directories trained here, in the two families real models use (nothing downloaded).

- `chatml`: GPT-2-style byte-level BPE with a ChatML template, like SmolLM2 and Qwen.
- `llama`: SentencePiece-style BPE with byte fallback and a BOS-adding post-processor, and
  Llama 2's template (BOS in the template, `raise_exception` for bad turn order).
- `llama3`: byte-level BPE split by Llama 3's regex, with its BOS-adding post-processor.

Both are trained on ASCII text only, so every non-ASCII character is split into several
byte tokens: the case incremental detokenization must get right.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from backends.deepinfer.tiny import train_byte_level_bpe

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "def main(argv): return 0  # comments and code tokens",
    "system user assistant tool: say hello, answer politely.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols {}[]()<>=+-*/",
] * 40

# Llama 3's pre-tokenizer regex (Qwen2's differs only in taking one digit at a time).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama 2's template, plus a `tojson` of the tools list when a caller passes one.
LLAMA_TEMPLATE = (
    "{% if tools %}{{ bos_token }}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif %}"
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


def build_chatml(out: Path) -> Path:
    tok = train_byte_level_bpe(CORPUS, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], vocab_size=600)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    _write(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|im_start|>",
            "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
            "pad_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
            "chat_template": CHATML_TEMPLATE,
            "model_max_length": 2048,
        },
    )
    _write(out / "generation_config.json", {"eos_token_id": [2, 0]})
    return out


def build_llama(out: Path) -> Path:
    special = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=special, limit_alphabet=80, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    # Byte fallback needs the 256 <0xNN> tokens in the vocabulary as ordinary tokens.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    _write(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "chat_template": [{"name": "default", "template": LLAMA_TEMPLATE}],
        },
    )
    return out


def build_llama3(out: Path) -> Path:
    """Built the way Llama 3's tokenizer is: a Split by its regex, then ByteLevel without one,
    merges ignored for a piece that is a token, a BOS added by a template; no chat template."""
    split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated")
    tok = train_byte_level_bpe(
        CORPUS,
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        vocab_size=700,
        model=models.BPE(ignore_merges=True),
        pre_tokenizer=pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    _write(out / "tokenizer_config.json", {"bos_token": "<|begin_of_text|>"})
    return out


def _write(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=1))
