"""The model as a Hugging Face folder: what ``transformers.AutoModelForCausalLM`` and ``AutoTokenizer`` load.

* **llama** runs become ``LlamaForCausalLM``: trainer/llama.py has its math and its parameter names, so the weights
  are copied as they are.
* **gpt** runs become ``GPT2LMHeadModel``: the GPT is GPT-2's math (pre-LN blocks, LayerNorm eps 1e-5, learned
  positions, biases on every linear layer, fused q/k/v in that order, scaled dot-product attention) except two
  settings the config states: exact (erf) GELU (``activation_function = "gelu"``, where GPT-2 uses the tanh
  approximation) and an untied head. GPT-2 stores its linear layers as ``Conv1D`` ([in, out]), so those weights are
  transposed; everything else is renamed (``blocks.i`` -> ``transformer.h.i``, ...).
* **The tokenizer**: a byte-level run (vocabulary 256, text read as UTF-8 bytes) gets a ``tokenizers`` fast tokenizer
  whose ids are the bytes themselves (a byte-level BPE without merges over GPT-2's byte alphabet), so
  ``AutoTokenizer`` encodes text to exactly the ids the swarm trained on and decodes them back; a run that names a
  ``tokenizer.json`` gets a copy of that file.

The folder is written by transformers' own ``save_pretrained`` (config.json, model.safetensors, tokenizer files),
plus ``asyncmesh.json`` (the run and where every stage's weights came from). transformers and tokenizers are the
``[hf]`` extra: ``pip install 'asyncmesh[hf]'``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from trainer.config import RunConfig
from trainer.tokenizer import import_hf

META = "asyncmesh.json"


def _require(module: str) -> Any:
    return import_hf(module, "the Hugging Face format")


def quiet() -> None:
    """No progress bars or notices from transformers and huggingface_hub (for the command line, which prints its own
    one-line result)."""
    transformers = _require("transformers")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def run_tokenizer(run: RunConfig) -> str | None:
    """The tokenizer.json the run names (``data.tokenizer``, resolved against the run file), else None."""
    return run.data.tokenizer or None


def is_byte_level(run: RunConfig) -> bool:
    return run.model.vocab_size == 256 and run.data.bin_vocab_size == 0 and run_tokenizer(run) is None


def hf_config(run: RunConfig) -> Any:
    """The transformers config of the run's model (LlamaConfig or GPT2Config)."""
    transformers = _require("transformers")
    c = run.model
    common: dict[str, Any] = {"vocab_size": c.vocab_size, "bos_token_id": None, "eos_token_id": None,
                              "pad_token_id": None, "tie_word_embeddings": c.tie_embeddings}
    if c.arch == "llama":
        return transformers.LlamaConfig(
            hidden_size=c.n_embd, intermediate_size=c.mlp_width, num_hidden_layers=c.n_layer,
            num_attention_heads=c.n_head, num_key_value_heads=c.kv_heads, max_position_embeddings=c.block_size,
            rms_norm_eps=c.rms_eps, rope_theta=c.rope_theta, hidden_act="silu", attention_bias=False,
            mlp_bias=False, **common)
    if c.arch == "gpt":
        return transformers.GPT2Config(
            n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head, n_inner=4 * c.n_embd,
            activation_function="gelu", resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout,
            layer_norm_epsilon=1e-5, scale_attn_weights=True, **common)
    raise ValueError(f"no Hugging Face class for model.arch {c.arch!r}")


_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def hf_state(run: RunConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole model's state (``trainer.export.gpt_state``) under the transformers class's names and layouts."""
    if run.model.arch == "llama":
        return dict(state)
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            out[name] = t
            continue
        hf = "transformer." + (name.replace("blocks.", "h.", 1) if name.startswith("blocks.") else name)
        out[hf] = t.t().contiguous() if name.endswith(_CONV1D) else t
    return out


def byte_tokenizer(block_size: int) -> Any:
    """A fast tokenizer whose ids are the UTF-8 bytes of the text (the byte-level runs' own encoding)."""
    tokenizers = _require("tokenizers")
    transformers = _require("transformers")
    from tokenizers import decoders, models, pre_tokenizers

    # GPT-2's printable stand-in for every byte, so a byte-level BPE without merges maps byte b to id b
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_in, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in stand_in:
            stand_in[b], extra = chr(256 + extra), extra + 1
    tok = tokenizers.Tokenizer(models.BPE(vocab={stand_in[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=block_size,
                                                clean_up_tokenization_spaces=False)


def save_hf(directory: str | Path, run: RunConfig, state: dict[str, torch.Tensor], *,
            tokenizer_json: str | Path | None = None, sources: dict[str, Any] | None = None) -> Path:
    """Write the Hugging Face folder into ``directory`` (which should be new and empty: see export.atomic_folder)."""
    transformers = _require("transformers")
    if tokenizer_json is None and not is_byte_level(run):
        raise ValueError(f"run {run.name!r} is not byte-level (vocabulary {run.model.vocab_size}): give the "
                         "tokenizer.json its data were tokenized with (--tokenizer)")
    d = Path(directory)
    config = hf_config(run)
    eos = None
    if tokenizer_json is not None:  # the id documents were joined with in training: where generation should stop
        eos = _require("tokenizers").Tokenizer.from_file(str(tokenizer_json)).token_to_id(run.data.eot_token)
        config.eos_token_id = eos
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(hf_state(run, state), strict=not run.model.tie_embeddings, assign=True)
    if run.model.tie_embeddings:
        model.tie_weights()
    model.eval().save_pretrained(d)
    if tokenizer_json is not None:
        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json),
                                                   model_max_length=run.model.block_size)
        vocab = tok.backend_tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab > run.model.vocab_size:
            raise ValueError(f"{tokenizer_json} has {vocab} tokens, more than the model's vocabulary "
                             f"({run.model.vocab_size}); it is not the run's tokenizer")
        if eos is not None:
            tok.eos_token = run.data.eot_token
    else:
        tok = byte_tokenizer(run.model.block_size)
    tok.save_pretrained(d)
    if tokenizer_json is not None:  # the file itself, byte for byte, rather than transformers' re-serialisation
        shutil.copyfile(tokenizer_json, d / "tokenizer.json")
    meta = {"run_id": run.run_id, "run_name": run.name, "arch": run.model.arch, "class": type(model).__name__,
            "tokenizer": "bytes" if tokenizer_json is None else Path(tokenizer_json).name, "sources": sources or {},
            "run": run.to_dict()}
    (d / META).write_text(json.dumps(meta, indent=1) + "\n")
    return d


def is_hf_folder(directory: str | Path) -> bool:
    """A folder ``save_hf`` (or transformers' save_pretrained) wrote: its config.json names a model_type."""
    try:
        return "model_type" in json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def load_hf(directory: str | Path, device: str = "cpu") -> tuple[Any, Any, int]:
    """(the transformers model in eval mode, its tokenizer, its context length) from a Hugging Face folder."""
    transformers = _require("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    cfg = model.config
    block = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 1024
    return model.to(device).eval(), tok, int(block)


def push_to_hub(directory: str | Path, repo: str, *, private: bool = False, token: str | None = None) -> str:
    """Upload the folder to the Hub repo ``repo`` (created if missing); returns the commit's URL."""
    hub = _require("huggingface_hub")
    api = hub.HfApi(token=token)
    api.create_repo(repo_id=repo, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(repo_id=repo, folder_path=str(directory), repo_type="model",
                             commit_message="asyncmesh export")
    return str(getattr(info, "commit_url", info))

