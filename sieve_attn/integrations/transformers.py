"""Composing sparse attention into Hugging Face transformers models, and adapters of what was added.

The composed model runs through transformers' own attention interface: ``compose`` registers the attention
function ``"sieve_focus"`` (and, for it, transformers' boolean SDPA mask builder), switches the model to it with
``set_attn_implementation``, attaches a :class:`FocusLayer` to every attention module as a submodule, and feeds it
the module's input hidden states through a forward pre-hook. No model class is patched; a model with Focus gets
its own ``_reorder_cache`` (the hook transformers' beam search calls), which reorders the routing kept for cached
tokens with the cache's rows.
"""
from __future__ import annotations

import functools
import json
import weakref
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from safetensors.torch import save_file
from torch import nn

from .._checks import check_tensors_fit, fail, fail_where, nan_checks_skipped
from .._files import atomic_write, read_safetensors
from ..config import FOCUS_INFERENCE_FIELDS, SFA_INFERENCE_FIELDS, FocusConfig, SFAConfig
from ..nn.focus_layer import FocusLayer
from ..nn.sfa_layer import SFALayer

ATTENTION_NAME = "sieve_focus"
LAYER_ATTR = "sieve_focus"
SFA_ATTR = "sieve_sfa"
START_ATTR = "sieve_pass_start"  # where the module's current pass starts in the sequence (_observe_pass)
ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FORMAT = 1


# Both run outside torch.compile's graphs (a graph break around each): their host-side bookkeeping (where a pass
# starts, the routing kept for cached tokens, document starts) reads the cache's length as a Python int, which
# dynamo would either refuse (a symbolic length) or guard on, recompiling every decode step. The model's other
# work (projections, MLPs) still compiles; transformers' generate compiles a static cache's decode step on CUDA.
@torch.compiler.disable
def sieve_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, **kwargs):
    """transformers attention-interface function: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> ([B, Tq, Hq, D], None).

    ``attention_mask`` is transformers' boolean SDPA mask (True = attend; it already holds causality, padding and
    the layer's own sliding window) or None for plain causal attention. Queries align with the end of the keys;
    the empty slots of a static cache are cut off first (:func:`_filled_slots`). With
    :class:`sieve_attn.SFACache`, ``key`` is a :class:`~sieve_attn.nn.sfa_layer.CachedKeys` that the layer's
    SFALayer reads. Under ``torch.autocast`` q, k and v are cast to the autocast dtype first, and the output comes
    in it.
    """
    focus, sfa = getattr(module, LAYER_ATTR, None), getattr(module, SFA_ATTR, None)
    if focus is None and sfa is None:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} used on a module without Focus or SFA; "
                           "build the model with sieve_attn.compose")
    if dropout and module.training:
        fail("dropout", "0 (sieve attention has no attention dropout; call model.eval(), or set the model "
             "config's attention dropout, e.g. attn_pdrop or attention_dropout, to 0 before loading it)", dropout)
    if kwargs.get("output_attentions"):
        fail("output_attentions", "False (sieve attention never builds the attention weights)", True)
    if not getattr(module, "is_causal", True):
        fail("module", "a causal (decoder) attention module", type(module).__name__)
    if kwargs.get("s_aux") is not None:
        fail("s_aux", "None (sieve attention has no learned attention sinks)", "a tensor")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = _boolean_mask(attention_mask)
    key, value, attention_mask = _filled_slots(key, value, attention_mask, getattr(module, START_ATTR, None),
                                               query.shape[2])
    if attention_mask is not None and query.shape[2] > 1 and not nan_checks_skipped():
        _refuse_later_keys(attention_mask)
    query, key, value = in_autocast_dtype(query, key, value)
    kwargs = dict(attn_mask=attention_mask, scale=scaling, softcap=softcap)
    out = sfa.attend(query, key, value, focus=focus, **kwargs) if sfa else focus.attend(query, key, value, **kwargs)
    return out.transpose(1, 2).contiguous(), None


# An additive mask entry at or below this removes its pair from the softmax as surely as -inf: exp(-1e4) underflows
# to 0 in every float dtype (transformers writes the dtype's minimum, older code -1e4).
_MASKED = -1e4


def _boolean_mask(additive: torch.Tensor) -> torch.Tensor:
    """True where an additive float mask holds 0 (attend). Its other entries must mask (at most -1e4: -inf, a float
    dtype's minimum, the -1e4 of older code): a finite bias such as ALiBi's would be lost, so it is refused, where
    value checks run (not inside :func:`sieve_attn.skip_nan_checks`). A mask of another dtype (integers) is
    refused: neither boolean nor additive."""
    if not additive.is_floating_point():
        fail("attention_mask", "a boolean mask (True = attend) or an additive float one (0 = attend)",
             f"a {additive.dtype} tensor")
    attended = additive == 0
    if not nan_checks_skipped():
        fail_where([("attention_mask", "an additive mask of 0 (attend) and values at most -1e4 (masked; Focus and "
                     "SFA add no bias to the logits)", "other values (a position bias such as ALiBi?)",
                     (~attended & (additive > _MASKED)).any())])
    return attended


def _refuse_later_keys(attn_mask: torch.Tensor) -> None:
    """ValueError naming ``attention_mask`` [B or 1, H or 1, Tq, Tk] (bool, queries aligned to the end of the keys)
    where a query may attend the key just after its own slot: Focus and SFA attend causally, so the pairs a
    bidirectional block adds (Gemma-3's image tokens attend each other both ways) would be dropped. Reads one
    diagonal: one host read."""
    q_len, k_len = attn_mask.shape[-2:]
    queries = torch.arange(q_len - 1, device=attn_mask.device)  # the last query's next slot lies past the keys
    fail_where([("attention_mask", "a causal mask (Focus and SFA attend no key after the query's own)",
                 "a query that may attend the token after it (bidirectional tokens, such as Gemma-3's image tokens)",
                 attn_mask[..., queries, queries + (k_len - q_len) + 1].any())])


def in_autocast_dtype(*tensors):
    """The tensors cast to the autocast dtype where autocast is on for their device (anything else passes as it
    is), as SDPA under autocast computes attention: transformers' RoPE hands back q and k in float32 there (its cos
    and sin are float32) beside the projection's bfloat16 v, a mix our ops and caches refuse."""
    device = next(t.device.type for t in tensors if isinstance(t, torch.Tensor))
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) else t for t in tensors)


def _filled_slots(key, value, attention_mask, start: Optional[int], q_len: int):
    """k, v [B, Hkv, Tk, D] and the mask [..., Tq, Tk] cut to the keys of the sequence so far, [..., :start + Tq].

    A static cache (transformers' ``StaticCache``, or a static sliding-window layer not yet full) hands over all its
    slots, those past the sequence still empty; transformers masks them, or passes no mask at all on a prefill
    into an empty cache and leaves the causal mask to SDPA's top-left alignment. The ops here align queries with
    the end of the keys, so the empty slots must go first. ``start`` is the cache's length before this pass (None
    without a cache): a dynamic cache, or a sliding layer that drops old keys, never holds more than start + Tq.
    """
    if start is None or not isinstance(key, torch.Tensor) or key.shape[2] <= start + q_len:
        return key, value, attention_mask
    filled = start + q_len
    mask = None if attention_mask is None else attention_mask[..., :filled]
    return key[:, :, :filled], value[:, :, :filled], mask


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, sieve_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The self-attention modules of a transformers model's text decoder (those carrying a ``layer_idx``), in layer
    order. In a model with other towers (a vision encoder's attention also carries a ``layer_idx``) only those of
    ``model.get_decoder()``."""
    inside = {id(m) for m in _text_decoder(model).modules()}
    found = [(name, m) for name, m in model.named_modules()
             if id(m) in inside and type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    if not found:
        fail("model", "a transformers decoder whose attention modules use the attention interface",
             f"no attention module in {type(model).__name__}")
    return found


def _text_decoder(model: nn.Module) -> nn.Module:
    """``model.get_decoder()`` where the model names one (transformers' lookup of the text decoder), else the
    model."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):  # no decoder, or one transformers cannot find
        return model
    return decoder if isinstance(decoder, nn.Module) else model


def focus_layers(model: nn.Module) -> Iterator[FocusLayer]:
    for _, module in attention_modules(model):
        layer = getattr(module, LAYER_ATTR, None)
        if layer is not None:
            yield layer


def sfa_layers(model: nn.Module) -> Iterator[SFALayer]:
    for _, module in attention_modules(model):
        layer = getattr(module, SFA_ATTR, None)
        if layer is not None:
            yield layer


def has_focus(model: nn.Module) -> bool:
    return getattr(model, "sieve_config", None) is not None


def is_composed(model: nn.Module) -> bool:
    """Composed with Focus, SFA or both."""
    return getattr(model, "sieve_config", None) is not None or getattr(model, "sieve_sfa_config", None) is not None


def reconfigure(model: nn.Module, **changes) -> nn.Module:
    """Changes the Focus settings of every layer of a composed model, e.g. ``mode="soft"`` or ``top_k=3``.

    Settings that shape the router (num_groups, group_dim) cannot change.
    """
    layers = list(focus_layers(model))
    if not layers:
        fail("model", "a model composed with a FocusConfig", "a model without Focus layers")
    for layer in layers:
        layer.reconfigure(**changes)
    model.sieve_config = layers[0].config
    return model


def set_focus_mode(model: nn.Module, mode: str) -> nn.Module:
    """Switches every Focus layer of a composed model to ``mode`` ("train", "soft", "hard" or "dense")."""
    return reconfigure(model, mode=mode)


@torch.compiler.disable  # see sieve_attention_forward
def _observe_pass(module, args, kwargs):
    """Forward pre-hook of every composed attention module: notes where this pass starts in the sequence (for
    :func:`_filled_slots`) and hands a Focus layer the pass's hidden states."""
    # The cache (named `cache` from transformers 5.2x, `past_key_values` before, `layer_past` in GPT-NeoX, Falcon
    # and GPT-BigCode) still holds only earlier tokens: its length is the absolute position of the first new token,
    # also for sliding-window and static layers.
    cache = next((kwargs[name] for name in ("cache", "past_key_values", "layer_past") if kwargs.get(name) is not None),
                 None)
    start = None if cache is None else int(cache.get_seq_length(module.layer_idx))
    setattr(module, START_ATTR, start)
    focus = getattr(module, LAYER_ATTR, None)
    if focus is not None:
        focus.observe(kwargs.get("hidden_states", args[0] if args else None), start, cache,
                      None if cache is None else functools.partial(_rows_token, cache, module.layer_idx))


def _reorder_cache(own: Optional[Callable], routed: list[tuple[int, FocusLayer]], cache, beam_idx: torch.Tensor):
    """A Focus model's ``_reorder_cache``, the hook transformers' beam search calls between steps when a model has
    one (RAG and RecurrentGemma define theirs): the cache's rows become its former rows ``beam_idx`` [B] (as the
    model's own hook ``own`` or the cache's ``reorder_cache`` does it), and the routing each Focus layer in
    ``routed`` ([(layer_idx, layer)]) keeps for the cached tokens follows them. Returns the cache."""
    if own is not None:
        cache = own(cache, beam_idx)
    else:
        cache.reorder_cache(beam_idx)
    for layer_idx, focus in routed:
        focus.follow_rows(cache, beam_idx, functools.partial(_rows_token, cache, layer_idx))
    return cache


def _rows_token(cache, layer_idx: int):
    """A token of the batch rows of a cache's layer (:meth:`FocusLayer.observe`'s ``rows``): an
    :class:`~sieve_attn.SFACache` layer counts the times its rows were reordered, selected or repeated; a layer
    of dense tensors gives the storage of its keys, which transformers replaces when it reorders, selects or
    repeats the rows (beam search) and when it appends, and keeps when it crops. None where neither applies (a
    static cache reorders its rows in place, and an offloading cache moves its keys to the CPU and back between
    passes, new storage each time: neither is checked for rows reordered by hand)."""
    if getattr(cache, "offloading", False):
        return None
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if hasattr(layer, "rows_version"):
        return layer.rows_version
    keys = getattr(layer, "keys", None)
    return _KeysStorage(keys) if isinstance(keys, torch.Tensor) and keys.numel() else None


class _KeysStorage:
    """A cache layer's rows token: the storage of its keys (equal tokens: the same storage). ``copy.deepcopy`` of
    the cache copies its keys before the routing kept on it (an attribute set after the cache's own), so the copied
    token names the copied keys' storage, read from deepcopy's memo; a token that cannot (its keys are gone, or the
    cache was pickled) equals none."""

    def __init__(self, keys: Optional[torch.Tensor]):
        self.pointer = None if keys is None else keys.untyped_storage().data_ptr()
        self._keys = None if keys is None else weakref.ref(keys)

    def __eq__(self, other) -> bool:
        return isinstance(other, _KeysStorage) and self.pointer is not None and self.pointer == other.pointer

    __hash__ = None

    def __deepcopy__(self, memo: dict) -> "_KeysStorage":
        keys = None if self._keys is None else self._keys()
        copied = None if keys is None else memo.get(id(keys))
        return _KeysStorage(copied if isinstance(copied, torch.Tensor) else None)

    def __getstate__(self) -> dict:
        return {"pointer": None, "_keys": None}


def _split_configs(configs) -> tuple[Optional[FocusConfig], Optional[SFAConfig]]:
    focus = [c for c in configs if isinstance(c, FocusConfig)]
    sfa = [c for c in configs if isinstance(c, SFAConfig)]
    other = [type(c).__name__ for c in configs if not isinstance(c, (FocusConfig, SFAConfig))]
    if other or not configs or len(focus) > 1 or len(sfa) > 1:
        fail("configs", "a FocusConfig, an SFAConfig, or one of each",
             f"{[type(c).__name__ for c in configs]}" if configs else "nothing")
    return (focus or [None])[0], (sfa or [None])[0]


def check_sfa_backend(model: nn.Module, backend: str) -> None:
    """ValueError naming ``backend`` when SFA alone under it cannot compute every call of ``model``: "sdpa" for a
    model that caps its logits (PyTorch's attention has no softcap), "triton" for one with sliding-window layers
    (they pass a mask, which the kernels do not take)."""
    softcap = getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
    if backend == "sdpa" and softcap is not None:
        fail("backend", f"an SFA backend that caps logits, as this model does at {softcap} ('auto' or 'reference', "
                        f"and 'triton' without sliding-window layers; PyTorch's attention under 'sdpa' has no "
                        f"softcap)", "'sdpa'")
    windows = [window for window in layer_windows(model) if window is not None] if backend == "triton" else []
    if windows:
        fail("backend", f"an SFA backend that takes a mask, as this model's sliding-window layers pass one past "
                        f"{min(windows)} tokens ('auto', 'reference' or 'sdpa'; the Triton kernels take none)",
             "'triton'")


def layer_windows(model: nn.Module) -> list[Optional[int]]:
    """Each attention layer's sliding window (None: full attention), as transformers' ``DynamicCache(config)``
    lays out the model's cache layers."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    windows = []
    for layer in DynamicCache(config=model.config).layers:
        if not isinstance(layer, DynamicSlidingWindowLayer) and type(layer) is not DynamicLayer:
            fail("model", "full or sliding-window attention layers", f"a {type(layer).__name__}")
        windows.append(getattr(layer, "sliding_window", None) if isinstance(layer, DynamicSlidingWindowLayer)
                       else None)
    return windows


def kv_heads(model: nn.Module) -> int:
    """The number of key/value heads of ``model``'s attention (its config's num_key_value_heads, else its heads)."""
    text = model.config.get_text_config()
    return getattr(text, "num_key_value_heads", None) or text.num_attention_heads


def head_dim(model: nn.Module) -> int:
    """The head dimension of ``model``'s attention (its config's head_dim, else hidden size / heads)."""
    text = model.config.get_text_config()
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def compose(model: nn.Module, *configs) -> nn.Module:
    """Composes ``model`` with a :class:`FocusConfig`, an :class:`SFAConfig`, or both, in place; returns it.

    Focus adds a router to every attention layer; SFA makes every layer's q and k keep their top-k coordinates
    (after RoPE); with both, SFA scores are computed inside the Focus pattern. Every original weight is frozen (only
    the routers are trainable; :func:`sieve_attn.train.finetune.finetune` unfreezes what SFA conversion trains), and
    attention runs through the ``"sieve_focus"`` attention function. The model keeps working with ``generate``
    and transformers' KV caches (dynamic, sliding-window and static), greedy, sampling and beam search (with Focus,
    the model's own ``_reorder_cache`` moves the routing kept for cached tokens with the beams); with SFA,
    :class:`sieve_attn.SFACache` keeps the compressed keys instead.
    """
    focus, sfa = _split_configs(configs)
    if is_composed(model):
        fail("model", "a model not yet composed", "a model already composed (load a fresh model)")
    if sfa is not None and sfa.topk > head_dim(model):
        fail("topk", f"at most the model's head dim {head_dim(model)}", sfa.topk)
    if sfa is not None and focus is None:
        check_sfa_backend(model, sfa.backend)
    modules = attention_modules(model)
    check_attention_fits(model, modules)
    _register()
    text = model.config.get_text_config()
    # Only the text decoder's: a vision tower keeps its own attention.
    key = next((name for name in getattr(model.config, "sub_configs", {}) if getattr(model.config, name, None) is text),
               None)
    configs = _configs(model)
    implementations = [config._attn_implementation_internal for config in configs]
    model.set_attn_implementation(ATTENTION_NAME if key is None else {key: ATTENTION_NAME})
    if text._attn_implementation != ATTENTION_NAME:  # transformers only warns
        # ... and may still have set it on a sub-config no submodel owns (MPT's attn_config): put every one back.
        for config, implementation in zip(configs, implementations):
            config._attn_implementation_internal = implementation
        fail("model", "a model whose attention runs through transformers' attention interface",
             f"{type(model).__name__}, which computes attention itself (its attention implementation stays "
             f"{text._attn_implementation!r})")
    device = next(model.parameters()).device
    for param in model.parameters():
        param.requires_grad_(False)
    for _, module in modules:
        if focus is not None:
            module.add_module(LAYER_ATTR, FocusLayer(text.hidden_size, focus).to(device).train(model.training))
        if sfa is not None:
            module.add_module(SFA_ATTR, SFALayer(sfa, kv_heads(model), head_dim(model)).to(device))
        module.register_forward_pre_hook(_observe_pass, with_kwargs=True)
    if focus is not None:
        routed = [(module.layer_idx, getattr(module, LAYER_ATTR)) for _, module in modules]
        model._reorder_cache = functools.partial(_reorder_cache, getattr(model, "_reorder_cache", None), routed)
    model.sieve_config, model.sieve_sfa_config = focus, sfa
    return model


def _configs(model: nn.Module) -> list:
    """Every config ``model.set_attn_implementation`` may change: the model's, its submodels', and their sub-configs
    at any depth, each once."""
    found, todo = {}, [model.config] + [module.config for module in model.modules() if hasattr(module, "config")]
    while todo:
        config = todo.pop()
        if id(config) not in found and hasattr(config, "_attn_implementation_internal"):
            found[id(config)] = config
            todo.extend(getattr(config, name, None) for name in getattr(config, "sub_configs", {}))
    return list(found.values())


def check_attention_fits(model: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
    """ValueError naming ``model`` when its attention is not what Focus and SFA replace, causal softmax attention
    over q k^T with nothing added to the logits but a mask: position biases (ALiBi: Falcon with ``alibi=True``),
    learned per-head attention sinks (GPT-OSS) and non-causal attention modules (an encoder's, cross-attention) are
    refused. (:func:`compose` refuses besides a model whose attention ignores transformers' attention interface,
    BLOOM's or MPT's, once transformers declines to switch it.)"""
    if getattr(model.config.get_text_config(), "alibi", False):
        fail("model", "a model without ALiBi position biases (Focus and SFA add nothing to the logits)",
             f"{type(model).__name__} with alibi=True")
    for name, module in modules:
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            fail("model", "attention without learned attention sinks (Focus and SFA have none)",
                 f"{name}.sinks in {type(model).__name__}")
        if not getattr(module, "is_causal", True):
            fail("model", "causal (decoder) self-attention modules only",
                 f"{name} ({type(module).__name__}, not causal)")


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything compose added (Focus router parameters and buffers, SFA feature maps), keyed as in
    ``model.state_dict()``."""
    return {k: v for k, v in model.state_dict().items() if f".{LAYER_ATTR}." in k or f".{SFA_ATTR}." in k}


def _model_signature(model: nn.Module) -> dict:
    text_config = model.config.get_text_config()
    return {"model_type": text_config.model_type, "hidden_size": text_config.hidden_size,
            "attention_layers": len(attention_modules(model))}


def save_adapter(model: nn.Module, directory, *, weights_digest: Optional[str] = None) -> Path:
    """Saves only what compose added (:func:`adapter_state`): ``adapter.safetensors`` and ``adapter_config.json``
    in ``directory``. ``weights_digest``: for an adapter trained together with the model's weights (SFA
    conversion), the digest of those weights' file (:func:`sieve_attn.train.finetune.load_weights` returns it),
    recorded as ``weights_digest`` so that whoever loads the adapter can check they have the same weights."""
    if not is_composed(model):
        fail("model", "a model composed with sieve_attn.compose", "a plain model")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in adapter_state(model).items()}
    focus, sfa = model.sieve_config, model.sieve_sfa_config
    config = {"format": ADAPTER_FORMAT, "method": _method(focus, sfa),
              "focus": None if focus is None else focus.to_dict(), "sfa": None if sfa is None else sfa.to_dict(),
              "base_model": _model_signature(model), "weights_digest": weights_digest}
    atomic_write(directory / ADAPTER_WEIGHTS, lambda tmp: save_file(tensors, tmp))
    atomic_write(directory / ADAPTER_CONFIG, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2)))
    return directory


def read_adapter_config(directory) -> dict:
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        fail("directory", f"an adapter folder holding {ADAPTER_CONFIG}", str(directory))
    return json.loads(path.read_text())


def _method(focus, sfa) -> str:
    return "+".join(name for name, config in (("focus", focus), ("sfa", sfa)) if config is not None)


def _trained_fields(config, inference_fields: tuple[str, ...]) -> Optional[dict]:
    if config is None:
        return None
    return {k: v for k, v in config.to_dict().items() if k not in inference_fields}


def trained_configs(focus: Optional[FocusConfig], sfa: Optional[SFAConfig]) -> dict:
    """{"focus", "sfa"}: what an adapter or a training checkpoint must share with the model that takes it, as
    JSON-able dicts (None for a method not composed): every field but those that only change how the trained
    parts are used (Focus: ``mode``, ``backend`` and ``top_k``; SFA: ``backend``)."""
    return {"focus": _trained_fields(focus, FOCUS_INFERENCE_FIELDS),
            "sfa": _trained_fields(sfa, SFA_INFERENCE_FIELDS)}


def composed_configs(model: nn.Module) -> dict:
    """:func:`trained_configs` of ``model`` (both None for a plain model)."""
    return trained_configs(getattr(model, "sieve_config", None), getattr(model, "sieve_sfa_config", None))


def load_adapter(model: nn.Module, directory, *, weights_digest: Optional[str] = None) -> nn.Module:
    """Loads an adapter saved by :func:`save_adapter`, composing ``model`` first when it is still plain (with the
    adapter's configs, its Focus mode and SFA backend included). A model already composed with the adapter's
    configs keeps its own mode, backends and Focus top_k (hard routing's groups per token, which training never
    reads); one composed with another method besides (Focus and SFA, taking an SFA
    adapter) keeps that method's state as it is. ``weights_digest``: that of the fine-tuned weights ``model``
    holds (:func:`sieve_attn.train.finetune.load_weights` returns it), None for its own.

    Refuses, with a ValueError and before it changes the model, a model of another type, width or depth, one
    composed with another config of a method the adapter holds, tensors that do not fit the layers the configs
    give this model, and, for an adapter trained together with fine-tuned weights (it records their digest),
    other weights than those.
    """
    focus, sfa, tensors = _checked_adapter(model, directory, weights_digest)
    if not is_composed(model):
        compose(model, *(c for c in (focus, sfa) if c is not None))
        if focus is not None:
            set_focus_mode(model, focus.mode)
    model.load_state_dict(tensors, strict=False)
    return model


def check_adapter(model: nn.Module, directory, *, weights_digest: Optional[str] = None) -> None:
    """ValueError where :func:`load_adapter` would refuse the adapter in ``directory`` for ``model`` (with
    ``weights_digest``); ``model`` is left as it is."""
    _checked_adapter(model, directory, weights_digest)


def _checked_adapter(model: nn.Module, directory, weights_digest: Optional[str]):
    """(FocusConfig or None, SFAConfig or None, tensors) of the adapter in ``directory``, checked against
    ``model`` as :func:`load_adapter` says; ``model`` is not changed."""
    saved = read_adapter_config(directory)
    if saved.get("format") != ADAPTER_FORMAT or saved.get("method") not in ("focus", "sfa", "focus+sfa"):
        fail("adapter", f"format {ADAPTER_FORMAT} of method 'focus', 'sfa' or 'focus+sfa'",
             f"format {saved.get('format')} of method {saved.get('method')!r}")
    focus = None if saved.get("focus") is None else FocusConfig.from_dict(saved["focus"])
    sfa = None if saved.get("sfa") is None else SFAConfig.from_dict(saved["sfa"])
    expected, actual = saved["base_model"], _model_signature(model)
    if expected != actual:
        fail("model", f"the model the adapter was trained on {expected}", actual)
    trained_with = saved.get("weights_digest")
    if trained_with is not None and weights_digest != trained_with:
        fail("weights_digest", f"{trained_with}, that of the fine-tuned weights the adapter was trained with (load "
                               f"them with sieve_attn.train.finetune.load_weights, which returns it)",
             weights_digest or "None (the model's own weights)")
    composed, saved_configs = composed_configs(model), trained_configs(focus, sfa)
    if is_composed(model):
        differ = [f"{method} " + ("not composed" if composed[method] is None else
                                  f"with {_differences(config, composed[method])}")
                  for method, config in saved_configs.items() if config is not None and composed[method] != config]
        if differ:
            fail("model", f"a model composed with the adapter's configs {focus}, {sfa}", "; ".join(differ))
    tensors = read_safetensors(Path(directory) / ADAPTER_WEIGHTS, "adapter")
    check_tensors_fit("adapter", tensors, _added_state(model, focus, sfa),
                      "tensors named as this model's Focus and SFA layers")
    for name, tensor in tensors.items():  # the layers rank by them unchecked (SFALayer.map_queries)
        if name.endswith(".selection_weights") and not (torch.isfinite(tensor) & (tensor >= 0)).all():
            fail(f"adapter tensor {name}", "finite selection weights >= 0", "a negative, infinite or NaN value")
    return focus, sfa, tensors


def _differences(expected: dict, got: dict) -> str:
    """"field got (adapter: expected), ..." of the fields whose values differ."""
    return ", ".join(f"{name} {got.get(name)!r} (adapter: {expected.get(name)!r})"
                     for name in sorted(set(expected) | set(got)) if expected.get(name) != got.get(name))


def _added_state(model: nn.Module, focus: Optional[FocusConfig], sfa: Optional[SFAConfig]) -> dict:
    """What :func:`adapter_state` of ``model`` composed with these configs holds, as shapes (tensors on the meta
    device), built without touching ``model``."""
    text = model.config.get_text_config()
    with torch.device("meta"):
        layers = {LAYER_ATTR: None if focus is None else FocusLayer(text.hidden_size, focus),
                  SFA_ATTR: None if sfa is None else SFALayer(sfa, kv_heads(model), head_dim(model))}
    return {f"{name}.{attr}.{key}": tensor for name, _ in attention_modules(model)
            for attr, layer in layers.items() if layer is not None for key, tensor in layer.state_dict().items()}
