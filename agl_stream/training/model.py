"""Hugging Face causal LMs as policies: a tiny randomly initialised one for CPUs (tests, the
demo), any local checkpoint for real runs; saved as safetensors with a content hash."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl_stream.training.hf import Policy, peft_calls, quiet_transformers

if TYPE_CHECKING:
    import torch

    from agl_stream.training.device import Placement

# Held while weights are drawn from torch's global generator after seeding it: trainers of
# several policies in one process create their policies in threads at the same time, and
# one's seed would otherwise reseed the other's draws half-way (runs no longer repeatable).
SEEDED_INIT = threading.RLock()

TINY = "tiny"
TINY_CHAT = "tiny-chat"
# The same models with 2 heads of 32 instead of 4 of 16 (the weights have the same shapes):
# vLLM's CPU attention kernels refuse a head size of 16.
WIDE_HEADS = "-h32"
CHAT_SPECIALS = ("<pad>", "<bos>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The tiny model's words: what the demo's task speaks. Specials first, as tokenizers expect.
TINY_WORDS = ("<pad>", "<bos>", "<eos>", "<unk>", "a", "b", "c", "d", "e")


def tiny_policy(seed: int = 0, heads: int = 4) -> Policy:
    """A two-layer Llama over TINY_WORDS, randomly initialised from `seed`."""
    quiet_transformers()
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(TINY_WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    name = TINY if heads == 4 else f"{TINY}{WIDE_HEADS}"
    return Policy(_tiny_llama(tokenizer, len(vocab), 64, seed, name, heads), tokenizer)


def tiny_chat_policy(seed: int = 0, heads: int = 4) -> Policy:
    """A two-layer Llama over bytes (byte-level BPE with no merges, so any text round-trips
    exactly) with a chat template: what the gateway and policy server are tested with."""
    quiet_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate((*CHAT_SPECIALS, *alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<|end|>",
        pad_token="<pad>",
        additional_special_tokens=list(CHAT_SPECIALS[3:]),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    name = TINY_CHAT if heads == 4 else f"{TINY_CHAT}{WIDE_HEADS}"
    return Policy(_tiny_llama(tokenizer, len(vocab), 256, seed, name, heads), tokenizer)


def _tiny_llama(
    tokenizer: Any, vocab_size: int, context: int, seed: int, name: str, heads: int
) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with SEEDED_INIT:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.config._name_or_path = name
    return model


def load_policy(path: str | Path, placement: Placement | None = None) -> Policy:
    """A checkpoint directory as save_pretrained wrote it, on `placement` (default: the CPU
    in the dtype the files hold). The weights are read in the placement's dtype, not in
    float32 first, so a 7B checkpoint in bfloat16 needs its own size in memory, not twice it."""
    quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory} is not a model checkpoint (no config.json)")
    options: dict[str, Any] = {}
    if placement is not None:
        options[_dtype_option()] = placement.torch_dtype
    model = AutoModelForCausalLM.from_pretrained(directory, **options)
    if placement is not None:
        model.to(placement.device)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return Policy(model, tokenizer)


def _dtype_option() -> str:
    """from_pretrained's name for the dtype: `dtype` since transformers 4.56 (which warns
    about the old `torch_dtype`), `torch_dtype` before."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def initial_policy(spec: str, seed: int, placement: Placement | None = None) -> Policy:
    """`tiny`, `tiny-chat` (either with `-h32`: the head size vLLM's CPU kernels accept), a
    pretrained model's short name, a GGUF file, or the path of a local checkpoint
    (pretrained.py resolves them)."""
    heads = 2 if spec.endswith(WIDE_HEADS) else 4
    name = spec.removesuffix(WIDE_HEADS)
    if name in (TINY, TINY_CHAT):
        policy = tiny_policy(seed, heads) if name == TINY else tiny_chat_policy(seed, heads)
        if placement is not None:
            policy.model.to(device=placement.device, dtype=placement.torch_dtype)
        return policy
    from agl_stream.training.pretrained import resolve_model

    return load_policy(resolve_model(spec), placement)


def save_policy(policy: Policy, directory: Path) -> None:
    """A whole model (weights and tokenizer), or only a LoRA adapter (adapter_config.json and
    adapter_model.safetensors, PEFT's layout) when the model is a peft one."""
    if is_adapter(policy.model):
        with peft_calls():
            policy.model.save_pretrained(directory, safe_serialization=True)
        return
    policy.model.save_pretrained(directory, safe_serialization=True)
    policy.tokenizer.save_pretrained(directory)


def is_adapter(model: Any) -> bool:
    """Whether `model` is a peft model (its trainable weights are an adapter's)."""
    return hasattr(model, "peft_config")


def content_hash(directory: Path) -> str:
    """sha256 over the weight files (names and bytes, in name order): what a runner checks
    before it trusts a checkpoint it was pointed at."""
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint {directory} does not exist (was it pruned?)")
    digest = hashlib.sha256()
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} holds no .safetensors weights")
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def set_threads(count: int) -> None:
    """Torch's intra-op threads: one per process when several share two cores."""
    import torch

    torch.set_num_threads(max(1, count))


def parameters(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
