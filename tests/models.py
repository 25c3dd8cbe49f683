"""Tiny randomly initialised transformers models shared by the integration and training tests.

Every architecture the design names (DESIGN.md, "Models and data, offline") at hidden size 64, 2 layers, vocab 100.
``initializer_range`` is larger than transformers' 0.02 so attention logits spread over several units: with the
default, attention is almost uniform and a wrong sparsity pattern, a lost softcap or a lost sliding window would
change the logits by less than the tolerances the tests use.
"""
from __future__ import annotations

import contextlib
import copy

import torch

VOCAB = 100
SEQ = 40          # tokens per test sequence (the sliding windows and the Focus window below are shorter)
SLIDING = 8       # sliding_window of Mistral and of Gemma-2's local layers

_COMMON = dict(vocab_size=VOCAB, initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None)
_DECODER = dict(_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel, GPT2Config(**_COMMON, n_embd=64, n_layer=2, n_head=4, n_positions=256)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM, LlamaConfig(**_DECODER)


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM, MistralConfig(**_DECODER, sliding_window=SLIDING)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM, Qwen2Config(**_DECODER)


def _olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM
    return Olmo2ForCausalLM, Olmo2Config(**_DECODER)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    # Layer 0 is sliding (window 8), layer 1 global. Softcaps small enough to bite at these logit scales;
    # query_pre_attn_scalar != head_dim, so the attention scale is not the default 1/sqrt(D).
    return Gemma2ForCausalLM, Gemma2Config(**_DECODER, head_dim=16, query_pre_attn_scalar=32, sliding_window=SLIDING,
                                           attn_logit_softcapping=2.0, final_logit_softcapping=3.0)


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM, Qwen3Config(**_DECODER, head_dim=16)


BUILDERS = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "olmo2": _olmo2,
            "gemma2": _gemma2, "qwen3": _qwen3}
ARCHS = list(BUILDERS)


def tiny_config(arch: str, **overrides):
    cls, config = BUILDERS[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return cls, config


def tiny_model(arch: str, seed: int = 0, attn_implementation: str | None = None, **overrides):
    """A fresh tiny model of ``arch`` in eval mode, fp32; the same ``seed`` gives the same weights.

    ``attn_implementation`` None keeps transformers' default for the class (SDPA; for Gemma-2 eager since some
    release after 5.17, SDPA before, which drops its softcap: a dense reference names eager)."""
    cls, config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = cls(config).eval()
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model


def eager_copy(model):
    """An independent uncomposed copy of ``model``'s original weights running transformers' eager attention: the
    reference the composed model is compared with. Router tensors (if ``model`` is composed) are left out."""
    reference = type(model)(copy.deepcopy(model.config)).eval()
    state = {k: v for k, v in model.state_dict().items() if ".sieve_focus." not in k}
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert not [k for k in missing if "lm_head" not in k], missing  # tied heads may be absent from state_dict
    reference.set_attn_implementation("eager")
    return reference


def random_ids(batch: int = 2, length: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def save_with_word_tokenizer(model, root, text: str):
    """Saves ``model`` (save_pretrained) to folder ``root`` with a word-level tokenizer of ``text`` holding
    :data:`VOCAB` tokens ([UNK] and [EOS] among them): a model folder the sieve commands load offline. Returns the
    ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([text], trainers.WordLevelTrainer(vocab_size=VOCAB,
                                                                    special_tokens=["[UNK]", "[EOS]"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(root)
    model.save_pretrained(root)
    return tokenizer


@contextlib.contextmanager
def threads(count: int):
    """Runs the body with ``count`` torch threads. Tiny models run fastest on one thread, above all on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def skip_without_cpu_kernels() -> None:
    """Skips a test whose tiny model runs the Triton kernels on the CPU: they take CPU tensors only in Triton's
    interpreter, which tests/conftest.py turns on where there is no CUDA (on a GPU machine the op tests run the
    kernels on the device instead)."""
    import pytest

    pytest.importorskip("triton")
    from sieve_attn.ops.triton_common import kernel_blocker

    blocker = kernel_blocker(torch.empty(1, 1, 1, 32))
    if blocker:
        pytest.skip(blocker)
