"""A small byte-level BPE tokenizer with ChatML tokens and a tool-calling chat template, built
on this machine with ``tokenizers`` (nothing is downloaded) and cached on disk.

Its normalizer and pre-tokenizer are the ones ``Qwen2Tokenizer`` rebuilds when it loads a
tokenizer folder, so token ids are identical before and after ``save_pretrained`` and
``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

from agentloop_core.cache import build_once, cache_dir

TINY_TOKENIZER_VERSION = "v1"
VOCAB_SIZE = 640

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
# Added but not special: like Qwen2.5, these survive skip_special_tokens=True in decode, so a
# parser can still see the tool-call markup.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Qwen2's split regex: contractions, letter runs, single digits, punctuation runs, newlines.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo", "Kai", "Lea"]
_ITEMS = ["apples", "books", "coins", "eggs", "marbles", "pens", "cookies", "stamps", "cards", "shells"]
_VERBS = ["buys", "finds", "gives away", "sells", "eats", "loses", "gets", "makes", "collects"]
_WORDS = ["the", "a", "an", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "was", "he", "she", "they", "we", "you", "this", "be", "at", "by", "from", "have", "has", "had", "not", "are", "or", "his", "her", "their", "there", "what", "which", "when", "how", "many", "much", "each", "more", "less", "than", "then", "total", "left", "after", "before", "every", "day", "week", "box", "bag", "group", "per", "times", "half", "twice", "answer", "question", "calculator", "result", "number", "sum", "difference", "product", "quotient", "first", "second", "third", "final", "so", "therefore", "because", "use", "tool", "call", "function", "arguments", "name", "expression", "value", "error", "invalid", "please", "try", "again", "correct", "wrong", "reward", "score", "user", "assistant", "system", "helpful", "math", "problem", "solve", "step", "think"]


def chat_template() -> str:
    """The ChatML tool-calling chat template shipped with the tiny tokenizer."""
    return resources.files("agentloop_core.testing").joinpath("chat_template.jinja").read_text()


def _corpus(n_lines: int = 6000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        a, b, c = rng.randint(0, 999), rng.randint(1, 99), rng.randint(1, 20)
        if kind < 0.35:
            lines.append(
                f"{rng.choice(_NAMES)} has {a} {rng.choice(_ITEMS)}. "
                f"{rng.choice(['She', 'He', 'They'])} {rng.choice(_VERBS)} {b} more and then "
                f"{rng.choice(_VERBS)} {c}. How many {rng.choice(_ITEMS)} are left?"
            )
        elif kind < 0.6:
            op = rng.choice(["+", "-", "*", "/"])
            expr = f"{a} {op} {b}" if rng.random() < 0.5 else f"({a} {op} {b}) * {c}"
            lines.append(
                '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
                + expr
                + '"}}\n</tool_call>'
            )
            lines.append(f"<tool_response>\n{a + b}\n</tool_response>")
            lines.append(f"The answer is {a + b}.\n#### {a + b}")
        elif kind < 0.8:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 20))) + ".")
        else:
            schema = {
                "type": "function",
                "function": {
                    "name": rng.choice(["calculator", "check_answer", "search", "python"]),
                    "description": " ".join(rng.choice(_WORDS) for _ in range(6)),
                    "parameters": {
                        "type": "object",
                        "properties": {"expression": {"type": "string", "description": "math"}},
                        "required": ["expression"],
                    },
                },
            }
            lines.append(json.dumps(schema))
    return lines


def _build(out_dir: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS) - len(MARKUP_TOKENS),
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    wrapped.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[1:]]}
    )
    wrapped.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    wrapped.chat_template = chat_template()
    wrapped.save_pretrained(out_dir)
    # Declare the Qwen2 classes so AutoTokenizer (and AutoConfig next to a tiny model) load it
    # as a Qwen2 tokenizer, exactly as they would load a real Qwen2.5 checkpoint.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg["add_prefix_space"] = False
    cfg["errors"] = "replace"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    (out_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))


def tiny_tokenizer_path(root: Path | str | None = None) -> Path:
    """Build (once) and return the folder of the tiny tokenizer."""
    target = Path(root) if root is not None else cache_dir() / f"tiny-tokenizer-{TINY_TOKENIZER_VERSION}"
    return build_once(target, _build)


def load_tiny_tokenizer(root: Path | str | None = None):
    """The tiny tokenizer, loaded through ``AutoTokenizer`` like any Hugging Face tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_path(root)))
